"""stages/model.py: a stage holds exactly its layer range (read from safetensors), and the
stages chained in-process reproduce HF's logits for a prompt, for every architecture."""
import pytest
import torch
from safetensors import safe_open

from ray_runtime.config import stage_layer_ranges
from stages.kv_cache import allocate_kv_cache
from stages.model import AttentionMetadata, build_stage
from stages.model_spec import ModelSpec
from tests.tiny_models import ARCHS


def _stages(model_dir, pp):
    spec = ModelSpec.from_dir(model_dir)
    ranges = stage_layer_ranges(spec.num_layers, pp, None)
    return spec, ranges, [build_stage(spec, r, i == 0, i == pp - 1, torch.float32, "cpu")
                          for i, r in enumerate(ranges)]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_stage_holds_only_its_layers(tiny_model, arch):
    model_dir = tiny_model(arch)
    spec, ranges, stages = _stages(model_dir, 3)
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        for rank, (stage, (start, end)) in enumerate(zip(stages, ranges)):
            assert len(stage.layers) == end - start
            assert (stage.embed_tokens is not None) == (rank == 0)
            assert (stage.lm_head is not None) == (rank == 2)
            for i in range(end - start):
                ours = stage.layers[i].self_attn.q_proj.weight
                assert torch.equal(ours, f.get_tensor(f"model.layers.{start + i}.self_attn.q_proj.weight"))
            if rank == 2:
                head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
                assert torch.equal(stage.lm_head.weight, f.get_tensor(head))
    names = set(stages[1].state_dict())
    assert not any(n.startswith(("embed_tokens", "norm.", "lm_head")) for n in names)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pp", [1, 3])
def test_chained_stages_match_hf_logits(tiny_model, arch, pp):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(arch)
    spec, ranges, stages = _stages(model_dir, pp)
    prompt = torch.arange(3, 43)
    block_size, n = 4, len(prompt)
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             block_tables=torch.arange(n // block_size).unsqueeze(0),
                             seq_lens=[n], query_start_loc=[0, n])
    x = prompt
    with torch.inference_mode():
        for stage, (start, end) in zip(stages, ranges):
            kv = allocate_kv_cache(spec, end - start, n // block_size, block_size, torch.float32, "cpu")
            x = stage(x, meta, kv)
        ours = stages[-1].compute_logits(x)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = hf(prompt.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_compute_the_same_layer(tiny_model, arch):
    """fuse() (q/k/v in one GEMM, gate/up in one; on CUDA in half precision) splits the fused
    output back correctly: the same logits as the three and two separate projections."""
    model_dir = tiny_model(arch)
    spec, ranges, (stage,) = _stages(model_dir, 1)
    prompt = torch.arange(3, 35)
    n, block_size = len(prompt), 4
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             block_tables=torch.arange(n // block_size).unsqueeze(0),
                             seq_lens=[n], query_start_loc=[0, n])

    def logits():
        kv = allocate_kv_cache(spec, spec.num_layers, n // block_size, block_size, torch.float32, "cpu")
        with torch.inference_mode():
            return stage.compute_logits(stage(prompt, meta, kv))

    before = logits()
    for layer in stage.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    assert stage.layers[0].self_attn.qkv_proj is not None and not hasattr(stage.layers[0].self_attn, "q_proj")
    torch.testing.assert_close(logits(), before, rtol=1e-5, atol=1e-5)

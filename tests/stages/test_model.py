"""stages/model.py: a stage holds exactly its layers, or its blocks of a layer split between
stages (read from safetensors), and the stages chained in-process reproduce HF's logits for a
prompt, for every architecture, with whole and half-layer partitions."""
import pytest
import torch
from safetensors import safe_open

from ray_runtime.layer_span import stage_blocks, stage_spans
from stages.kv_cache import allocate_kv_cache
from stages.model import AttentionMetadata, build_stage
from stages.model_spec import ModelSpec
from tests.tiny_models import ARCHS


def _stages(model_dir, pp, partition=None):
    spec = ModelSpec.from_dir(model_dir)
    ranges = stage_spans(spec.num_layers, pp, partition)
    return spec, ranges, [build_stage(spec, r, i == 0, i == pp - 1, torch.float32, "cpu")
                          for i, r in enumerate(ranges)]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_stage_holds_only_its_layers(tiny_model, arch):
    model_dir = tiny_model(arch)
    spec, ranges, stages = _stages(model_dir, 3, "even")  # whole layers (halves: below)
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        for rank, (stage, span) in enumerate(zip(stages, ranges)):
            start, end = span.layers.start, span.layers.stop
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


def test_a_split_layer_is_held_in_blocks(tiny_model):
    """1.5,2,1.5 of 5 layers: rank 0 holds layer 0 and layer 1's attention, rank 1 layer 1's
    MLP, layer 2 and layer 3's attention, rank 2 layer 3's MLP and layer 4; each block's
    tensors are the checkpoint's, and no stage holds a block it does not run."""
    model_dir = tiny_model("llama")
    spec, spans, stages = _stages(model_dir, 3, (1.5, 2, 1.5))
    held = [[(i, layer.self_attn is not None, layer.mlp is not None)
             for i, layer in zip(span.layers, stage.layers)] for span, stage in zip(spans, stages)]
    assert held == [[(0, True, True), (1, True, False)],
                    [(1, False, True), (2, True, True), (3, True, False)],
                    [(3, False, True), (4, True, True)]]
    assert [list(s.attention_layers) for s in spans] == [[0, 1], [2, 3], [4]]
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        for span, stage in zip(spans, stages):
            for name, tensor in stage.state_dict().items():
                if name.startswith("layers."):
                    idx, rest = name[len("layers."):].split(".", 1)
                    ckpt = f"model.layers.{span.layers.start + int(idx)}.{rest}"
                    assert torch.equal(tensor, f.get_tensor(ckpt)), name
    assert "layers.1.mlp.down_proj.weight" not in stages[0].state_dict()
    assert "layers.0.self_attn.q_proj.weight" not in stages[1].state_dict()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pp,partition", [(1, None), (3, None), (2, (2.5, 2.5)),
                                          (3, (1.5, 2, 1.5))])
def test_chained_stages_match_hf_logits(tiny_model, arch, pp, partition):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(arch)
    if partition is not None and sum(partition) != ModelSpec.from_dir(model_dir).num_layers:
        partition = partition[:-1] + (partition[-1] + 2,)  # qwen2 has 7 layers
    spec, ranges, stages = _stages(model_dir, pp, partition)
    prompt = torch.arange(3, 43)
    block_size, n = 4, len(prompt)
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             block_tables=torch.arange(n // block_size).unsqueeze(0),
                             seq_lens=[n], query_start_loc=[0, n])
    x = prompt
    with torch.inference_mode():
        for stage, span in zip(stages, ranges):
            kv = allocate_kv_cache(spec, len(span.attention_layers), n // block_size, block_size,
                                   torch.float32, "cpu")
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


def test_a_stage_refuses_kv_caches_that_do_not_match_its_attention_layers(tiny_model):
    spec, spans, stages = _stages(tiny_model("llama"), 2, (2.5, 2.5))
    assert [len(s.attention_layers) for s in spans] == [3, 2]
    meta = AttentionMetadata(positions=torch.arange(4), slot_mapping=torch.arange(4),
                             block_tables=torch.arange(1).unsqueeze(0), seq_lens=[4],
                             query_start_loc=[0, 4])
    for n in (2, 4):  # one per layer touched (3 on rank 0 too) would be wrong either way
        kv = allocate_kv_cache(spec, n, 1, 4, torch.float32, "cpu")
        with pytest.raises(ValueError, match="KV caches for 3 attention layers"):
            stages[0](torch.arange(3, 7), meta, kv)


@pytest.mark.parametrize("partition,prefill", [((2, 1.5, 1.5), (1.5, 2, 1.5)),
                                               ((2, 2, 1), (2, 1.5, 1.5))])
def test_stages_with_a_prefill_split_run_either_kind_of_step(tiny_model, partition, prefill):
    """A stage holds the MLP block at a boundary that the prefill split moves (both
    neighbours do), runs it only in the steps of its kind, and the chain gives HF's logits
    for both kinds; the first pair moves layer 1's MLP to rank 1, the second layer 3's to
    rank 2."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("llama")
    spec = ModelSpec.from_dir(model_dir)
    blocks = stage_blocks(spec.num_layers, 3, partition, prefill, spec.attention_share)
    stages = [build_stage(spec, b.decode, i == 0, i == 2, torch.float32, "cpu",
                          prefill_span=b.prefill) for i, b in enumerate(blocks)]
    moved = [b for b in blocks if b.decode != b.prefill]
    assert len(moved) == 2  # the two stages beside the moved block
    for b, stage in zip(blocks, stages):  # each holds the union, no more
        assert [i for i, layer in zip(b.held.layers, stage.layers) if layer.mlp is not None] == \
            [i for i in b.held.layers if b.decode.has_mlp(i) or b.prefill.has_mlp(i)]
    prompt = torch.arange(3, 43)
    block_size, n = 4, len(prompt)
    meta = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(n),
                             block_tables=torch.arange(n // block_size).unsqueeze(0),
                             seq_lens=[n], query_start_loc=[0, n])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(prompt.unsqueeze(0)).logits[0]
        for prefill_shaped in (False, True):
            x = prompt
            for stage, b in zip(stages, blocks):
                kv = allocate_kv_cache(spec, len(b.decode.attention_layers), n // block_size,
                                       block_size, torch.float32, "cpu")
                x = stage(x, meta, kv, prefill_shaped=prefill_shaped)
            torch.testing.assert_close(stages[-1].compute_logits(x), ref, rtol=1e-4, atol=1e-4)
        # a stage run on the other kind's blocks is not the same function: the split matters
        x = prompt
        for stage, b, kind in zip(stages, blocks, (False, True, False)):
            kv = allocate_kv_cache(spec, len(b.decode.attention_layers), n // block_size,
                                   block_size, torch.float32, "cpu")
            x = stage(x, meta, kv, prefill_shaped=kind)
        assert not torch.allclose(stages[-1].compute_logits(x), ref, rtol=1e-4, atol=1e-4)

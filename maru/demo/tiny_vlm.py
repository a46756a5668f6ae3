"""Generate a tiny LLaVA-architecture vision-language model with random weights.

A CLIP vision tower and a two-layer projector feed a small Llama text model (the one
:mod:`maru.demo.tiny_model` makes), with the same locally trained byte-level BPE tokenizer plus
an ``<image>`` special token. No downloads; the same spec gives byte-identical files on every run,
and a directory already holding the same spec is reused (``maru-tiny-vlm.json`` says which). vLLM
loads it as ``LlavaForConditionalGeneration``.

    python -m maru.demo.tiny_vlm OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from maru.demo.tiny_model import TinyModelSpec, _train_tokenizer, begin_build, llama_config

SPEC_FILE = "maru-tiny-vlm.json"
IMAGE_TOKEN = "<image>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass(frozen=True)
class TinyVlmSpec:
    """The model's shape: a text model as :class:`TinyModelSpec`, and a CLIP vision tower.

    An image becomes ``(image_size / patch_size) ** 2`` placeholder tokens (the CLS position is
    dropped by the "default" feature-select strategy): 16 for the defaults. ``vision_weight_std``
    scales the tower's and projector's random weights, large enough that different images give
    different greedy outputs.
    """

    text: TinyModelSpec = TinyModelSpec()
    image_size: int = 56
    patch_size: int = 14
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_heads: int = 2
    vision_layers: int = 2
    vision_weight_std: float = 0.2
    seed: int = 4321

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image."""
        return (self.image_size // self.patch_size) ** 2


def _add_image_token(out: Path) -> tuple[Any, int]:
    """Add ``<image>`` as a special token to the tokenizer saved in ``out``; return it and its id."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    if not isinstance(image_id, int) or len(tok(IMAGE_TOKEN, add_special_tokens=False)["input_ids"]) != 1:
        raise RuntimeError(f"{IMAGE_TOKEN} is not a single token")
    return tok, image_id


def _config(spec: TinyVlmSpec, vocab: int, image_id: int) -> Any:
    """The ``LlavaConfig`` for ``spec`` with a text vocabulary of ``vocab`` tokens."""
    from transformers import CLIPVisionConfig, LlavaConfig

    text = llama_config(spec.text, vocab)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
        hidden_act="quick_gelu",
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=spec.image_tokens,
        tie_word_embeddings=False,
    )


def _checkpoint_name(name: str) -> str:
    """The checkpoint name for a parameter of transformers' ``LlavaForConditionalGeneration``.

    transformers 5 flattens ``CLIPVisionModel`` (no ``vision_model.`` level) and its
    ``save_pretrained`` writes the tower as ``vision_tower.embeddings...``, which vLLM's
    ``CLIPVisionModel`` does not load. Write the layout of the published llava-hf checkpoints
    (``model.vision_tower.vision_model...``, ``model.language_model...``, ``lm_head...``), which
    both vLLM and transformers read.
    """
    prefix = "model.vision_tower."
    if name.startswith(prefix) and not name.startswith(prefix + "vision_model."):
        return prefix + "vision_model." + name[len(prefix) :]
    return name


def _write_model(spec: TinyVlmSpec, config: Any, out: Path) -> None:
    """Save seeded random weights (``model.safetensors``) and the config."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.text.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in sorted(model.named_parameters()):
        text = "language_model" in name or name.startswith("lm_head")
        std = spec.text.weight_std if text else spec.vision_weight_std
        module = name.rsplit(".", 2)[-2]
        if "norm" in module:  # RMSNorm / LayerNorm (CLIP spells one "pre_layrnorm")
            value = torch.full(p.shape, 1.0 if name.endswith("weight") else 0.0)
        else:
            # Wide random weights, so greedy decoding is not one repeated token and different
            # images give different outputs.
            value = torch.randn(p.shape, generator=gen) * std
        tensors[_checkpoint_name(name)] = value.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # Without ``architectures`` vLLM resolves the bare ``LlavaModel`` and runs it as a pooling model.
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(str(out))


def _write_processor(spec: TinyVlmSpec, tokenizer: Any, out: Path) -> None:
    """Save a ``LlavaProcessor``: a CLIP image processor sized to the tower, and the tokenizer."""
    from transformers import LlavaProcessor

    try:  # transformers >= 5: the PIL backend needs no torchvision
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - transformers 4
        from transformers import CLIPImageProcessor as ImageProcessor

    size = spec.image_size
    images = ImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))


def build_tiny_llava(out_dir: str | os.PathLike[str], spec: TinyVlmSpec | None = None) -> Path:
    """Write (or reuse) the LLaVA model for ``spec`` in ``out_dir``; return the directory."""
    spec = spec or TinyVlmSpec()
    out = Path(out_dir)
    marker = out / SPEC_FILE
    wanted = json.loads(json.dumps(asdict(spec), sort_keys=True))
    if not begin_build(marker, wanted):
        return out
    _train_tokenizer(spec.text.vocab, out)
    tokenizer, image_id = _add_image_token(out)
    vocab = -(-len(tokenizer) // 64) * 64  # room for the added token, rounded up
    config = _config(spec, vocab, image_id)
    _write_model(spec, config, out)
    _write_processor(spec, tokenizer, out)
    marker.write_text(json.dumps(wanted, sort_keys=True))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: build the model into the given directory and print its path."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    d = TinyVlmSpec()
    ap.add_argument("--image-size", type=int, default=d.image_size)
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(argv)
    print(build_tiny_llava(a.out_dir, TinyVlmSpec(image_size=a.image_size, seed=a.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

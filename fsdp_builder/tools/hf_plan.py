"""A Hugging Face transformers model on the meta device from its ``config.json``, for
``fsdp-builder plan FOLDER``.

``accelerate estimate-memory`` does the same for hub names: only the configuration is read, the
model is created on the meta device (no memory, no weights), and the plan and estimates are
those of the real model. transformers is imported only when a folder is planned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_builder.errors import ConfigurationError, config_error

CONFIG_NAME = "config.json"
_WHERE = "fsdp-builder plan"
_ARGUMENT = "FOLDER"


def is_config_path(spec: str) -> bool:
    """Whether ``plan``'s argument names a folder or a ``.json`` file rather than a
    ``MODULE:FACTORY`` (an existing path, a path with a separator, or a ``.json`` name)."""
    return os.path.exists(spec) or os.sep in spec or "/" in spec or spec.endswith(".json")


def config_file(spec: str | os.PathLike[str]) -> Path:
    """The ``config.json`` that ``spec`` (a folder, or the file itself) names; raises a
    ConfigurationError when there is none."""
    path = Path(spec)
    if path.is_dir():
        found = path / CONFIG_NAME
        if not found.is_file():
            raise config_error(
                _WHERE,
                _ARGUMENT,
                f"the folder {str(path)!r} has no {CONFIG_NAME}",
                "Pass a folder written by `save_pretrained` (or `config.save_pretrained`), or "
                "the path of its config.json",
            )
        return found
    if not path.is_file():
        raise config_error(
            _WHERE,
            _ARGUMENT,
            f"{str(path)!r} does not exist",
            "Pass the folder that holds the model's config.json, or the file itself; for a "
            "Python model pass MODULE:FACTORY (e.g. mymodel:make)",
        )
    return path


def meta_model_from_config(spec: str | os.PathLike[str]) -> nn.Module:
    """The model a transformers ``config.json`` describes, created on the meta device.

    The class is the first of the config's ``architectures`` (e.g. ``LlamaForCausalLM``), or
    ``AutoModelForCausalLM`` for the config when it names none (``AutoModel`` for a model type
    that has no causal-LM head). Nothing is downloaded and no code from the folder is run.

    Args:
        spec: a folder holding ``config.json`` (as ``save_pretrained`` writes it), or the path
            of the ``.json`` file itself.

    Raises:
        ConfigurationError: transformers is not installed, there is no ``config.json``, or the
            file is not a configuration transformers knows.
    """
    path = config_file(spec)
    try:
        import transformers
    except ImportError as exc:
        raise config_error(
            _WHERE,
            _ARGUMENT,
            f"planning {str(spec)!r} from its {CONFIG_NAME} needs transformers, which is not "
            "installed",
            "Install it (`pip install transformers`), or pass MODULE:FACTORY",
        ) from exc
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise config_error(
            _WHERE,
            _ARGUMENT,
            f"{str(path)!r} is not a transformers configuration ({type(exc).__name__}: {exc})",
            "Pass the config.json that `save_pretrained` wrote, with its `model_type`",
        ) from exc
    with torch.device("meta"):
        return _model_class(transformers, config, path)(config)


def _model_class(transformers: Any, config: Any, path: Path) -> type[nn.Module]:
    names: list[str] = list(getattr(config, "architectures", None) or [])
    if names:
        cls = getattr(transformers, names[0], None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise config_error(
                _WHERE,
                _ARGUMENT,
                f"{str(path)!r} names the architecture {names[0]!r}, which this transformers "
                f"({getattr(transformers, '__version__', '?')}) does not have",
                "Upgrade transformers, or remove `architectures` from the config to use "
                "AutoModelForCausalLM",
            )
        return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        mapping = auto._model_mapping
        if type(config) in mapping:
            found: type[nn.Module] = mapping[type(config)]
            return found
    raise ConfigurationError(
        f"`{_WHERE}` got an invalid `{_ARGUMENT}`: {str(path)!r} has no `architectures` and "
        f"transformers has no model for its {type(config).__name__}. Add the model class to "
        "the config's `architectures`"
    )


__all__ = ["CONFIG_NAME", "config_file", "is_config_path", "meta_model_from_config"]

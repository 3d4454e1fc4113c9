"""A transformers model on the meta device from its ``config.json``, for
``fsdp-builder plan FOLDER`` (transformers is imported only then)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_builder.errors import ConfigurationError, config_error

CONFIG_NAME = "config.json"


def _refused(problem: str, fix: str) -> ConfigurationError:
    return config_error("fsdp-builder plan", "FOLDER", problem, fix)


def is_config_path(spec: str) -> bool:
    """Whether ``plan``'s argument names a folder or ``.json`` file, not ``MODULE:FACTORY``."""
    return os.path.exists(spec) or os.sep in spec or "/" in spec or spec.endswith(".json")


def config_file(spec: str | os.PathLike[str]) -> Path:
    """The ``config.json`` ``spec`` (a folder, or the file) names; ConfigurationError if none."""
    path = Path(spec)
    if path.is_dir():
        found = path / CONFIG_NAME
        if not found.is_file():
            raise _refused(
                f"the folder {str(path)!r} has no {CONFIG_NAME}",
                "Pass a folder written by `save_pretrained` (or `config.save_pretrained`), or "
                "the path of its config.json",
            )
        return found
    if not path.is_file():
        raise _refused(
            f"{str(path)!r} does not exist",
            "Pass the folder that holds the model's config.json, or the file itself; for a "
            "Python model pass MODULE:FACTORY (e.g. mymodel:make)",
        )
    return path


# The dtypes a config.json may name for the model's weights, by the name it writes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(spec: str | os.PathLike[str]) -> torch.dtype | None:
    """The weights' dtype a ``config.json`` names (``dtype``, or ``torch_dtype`` as older
    transformers write it); None where it names none, or "auto"."""
    try:
        settings = json.loads(config_file(spec).read_text())
    except (OSError, ValueError):
        return None  # meta_model_from_config names what is wrong with the file
    if not isinstance(settings, dict):
        return None
    name = settings.get("dtype") or settings.get("torch_dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def meta_model_from_config(
    spec: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> nn.Module:
    """The model a transformers ``config.json`` describes, created on the meta device; its
    floating-point parameters and buffers in ``dtype`` where given (as transformers' own
    ``from_pretrained(..., dtype=...)`` casts them), else as the classes make them.

    The class is the first of ``architectures``, else ``AutoModelForCausalLM`` (or
    ``AutoModel``). Nothing is downloaded and no code from the folder is run.

    Raises:
        ConfigurationError: transformers is not installed, there is no ``config.json``, a
            size in it is not a whole number of 0 or more (the key is named), or the file is not
            a configuration transformers accepts or can build a model from.
    """
    path = config_file(spec)
    try:
        import transformers
    except ImportError as exc:
        raise _refused(
            f"planning {str(spec)!r} from its {CONFIG_NAME} needs transformers, which is not "
            "installed",
            "Install it (`pip install transformers`), or pass MODULE:FACTORY",
        ) from exc
    check_sizes(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers' and huggingface_hub's validators raise their own
        raise _refused(
            f"{str(path)!r} is not a configuration transformers accepts "
            f"({type(exc).__name__}: {_one_line(exc)})",
            "Fix the value it names in the config.json (as `save_pretrained` writes it, with its "
            "`model_type`)",
        ) from exc
    cls = _model_class(transformers, config, path)
    try:
        with torch.device("meta"):
            model = cls(config)
            return model if dtype is None else model.to(dtype)
    except Exception as exc:  # a value no validator caught, met by a layer's constructor
        raise _refused(
            f"{cls.__name__} cannot be created from {str(path)!r} "
            f"({type(exc).__name__}: {_one_line(exc)})",
            "Fix the sizes in the config.json: they must be the model's real dimensions",
        ) from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# Keys whose values are sizes or counts: an int, a list of ints (image sizes), or null.
_SIZE_KEY = re.compile(r"^(num_|n_)|(_size|_dim|_layers|_heads|_embd|_positions)$|^d_(model|ff)$")


def check_sizes(path: Path) -> None:
    """Refuse a size or count that cannot be one (``hidden_size: -64``), naming the key, which
    transformers' own errors would not; -1 (a sentinel) and null are left to transformers."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refused(
            f"{str(path)!r} is not a JSON file ({type(exc).__name__}: {_one_line(exc)})",
            "Pass the config.json that `save_pretrained` wrote",
        ) from exc
    if not isinstance(raw, dict):
        raise _refused(
            f"{str(path)!r} holds a JSON {type(raw).__name__}, not an object of settings",
            "Pass the config.json that `save_pretrained` wrote",
        )
    for key, value in _sizes(raw, ""):
        values = value if isinstance(value, list) else [value]
        if not all(_may_be_size(v) for v in values):
            raise _refused(
                f"{str(path)!r} sets {key}={value!r}, which is not a size: sizes and counts "
                "are whole numbers of 0 or more",
                f"Set {key} in the config.json to the model's own value, a whole number",
            )


def _sizes(settings: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """The size-like settings, nested configs' included, with their dotted names."""
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _sizes(value, f"{name}.")
        elif _SIZE_KEY.search(str(key)):
            yield name, value


def _may_be_size(value: Any) -> bool:
    if value is None or isinstance(value, float):
        return True  # null: derived by the config; a float: transformers' own check decides
    return isinstance(value, int) and not isinstance(value, bool) and value >= -1


def _model_class(transformers: Any, config: Any, path: Path) -> type[nn.Module]:
    names: list[str] = list(getattr(config, "architectures", None) or [])
    if names:
        cls = getattr(transformers, names[0], None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise _refused(
                f"{str(path)!r} names the architecture {names[0]!r}, which this transformers "
                f"({getattr(transformers, '__version__', '?')}) does not have",
                "Upgrade transformers, or remove `architectures` from the config to use "
                "AutoModelForCausalLM",
            )
        return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise _refused(
        f"{str(path)!r} has no `architectures` and transformers has no model for its "
        f"{type(config).__name__}",
        "Add the model class to the config's `architectures`",
    )


__all__ = [
    "CONFIG_NAME",
    "check_sizes",
    "config_file",
    "is_config_path",
    "config_dtype",
    "meta_model_from_config",
]

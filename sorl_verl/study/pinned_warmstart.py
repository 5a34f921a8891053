"""A study's warm-start pinned by content, so that its runs start from the same weights on any CPU.

The embedded warm-start is trained on the machine that builds it, and its weights differ between CPU
kinds (AVX2 / AVX-512 kernels round differently over 600 SFT steps; :func:`model_digest`). A study
whose seeds and arms span several machines therefore ships its warm-start: a grid's
``warmstart_pin`` names a ``.tar.xz`` of the model folder (weights, config, tokenizer) whose name
ends in ``-<digest>.tar.xz``. :func:`pinned_model` unpacks it once next to the built warm-start and
checks that the unpacked weights have that digest; the runs then load it instead of the local build.

    python -m sorl_verl.study.pinned_warmstart MODEL_DIR OUT_DIR   # write OUT_DIR/warmstart-<digest>.tar.xz
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

__all__ = ["PinError", "check_built", "model_digest", "pin_digest", "pinned_model", "write_pin"]

#: ``<anything>-<16 hex digits>.tar.xz``: the digest a pin's weights must have
PIN_NAME = re.compile(r"-([0-9a-f]{16})\.tar\.xz$")
#: files of a model folder that go into a pin (the weights and what loading them needs)
PIN_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model")


class PinError(ValueError):
    """A pinned warm-start that is missing, misnamed or does not hold the weights its name says."""


def model_digest(model_dir: Path) -> str | None:
    """First 16 hex digits of the SHA-256 of the weight files' SHA-256s, in name order (None when
    there are none)."""
    from sorl_verl.retrieval.corpus import sha256_file

    files = sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.bin"))
    if not files:
        return None
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()[:16]


def pin_digest(pin: Path) -> str:
    """The digest a pin's name promises (``...-<digest>.tar.xz``)."""
    match = PIN_NAME.search(Path(pin).name)
    if match is None:
        raise PinError(f"pinned warm-start {pin}: the name must end in -<16 hex digits of its digest>.tar.xz")
    return match.group(1)


def write_pin(model_dir: Path, out_dir: Path, prefix: str = "warmstart") -> Path:
    """Pack the model folder's weights, config and tokenizer as ``out_dir/<prefix>-<digest>.tar.xz``."""
    digest = model_digest(model_dir)
    if digest is None:
        raise PinError(f"{model_dir} holds no weights (*.safetensors / *.bin)")
    out = Path(out_dir) / f"{prefix}-{digest}.tar.xz"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz") as tar:
        for f in sorted(Path(model_dir).iterdir()):
            if f.is_file() and not f.name.startswith(".") and f.suffix in PIN_SUFFIXES:
                tar.add(f, arcname=f.name)
    return out


def pinned_model(pin: Path, cache_dir: Path) -> Path:
    """The model folder of ``pin``, unpacked once into ``cache_dir/model-<digest>`` and checked.

    Raises :class:`PinError` when the pin is missing or its weights do not have its name's digest.
    """
    pin = Path(pin)
    digest = pin_digest(pin)
    if not pin.is_file():
        raise PinError(f"pinned warm-start {pin} not found (the grid's warmstart_pin)")
    target = Path(cache_dir) / f"model-{digest}"
    if target.is_dir() and model_digest(target) == digest:
        return target
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(pin, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        found = model_digest(tmp)
        if found != digest:
            raise PinError(f"pinned warm-start {pin} holds weights of digest {found}, not {digest} as its name says")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def check_built(model_dir: Path, digest: str) -> None:
    """Refuse a machine whose own build of the warm-start is not the one a grid's runs started from
    (a grid's ``warmstart_digest``, for a study whose weights were never pinned)."""
    found = model_digest(model_dir)
    if found != digest:
        raise PinError(
            f"this machine built the warm-start {model_dir} with digest {found}, but the grid's runs started from "
            f"{digest} (warmstart_digest): the CPU kinds round differently (AVX2 / AVX-512). Run the grid on a "
            "machine that builds those weights, or move the cells to a grid with a warmstart_pin"
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(write_pin(Path(args[0]), Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model store: one directory per model version holding the exported model and its signature.

    <store>/<model>/<version>/model.jaxexport   # jax.export.Exported.serialize()
    <store>/<model>/<version>/signature.json    # jaxscale.serving.Signature, written last

The signature is written after the artifact, both atomically, so a version whose signature exists is complete.
"""

from __future__ import annotations

from pathlib import Path

ARTIFACT = "model.jaxexport"
SIGNATURE = "signature.json"


def version_dir(store: str | Path, model: str, version: str) -> Path:
    return Path(store) / model / version


def signature_path(store: str | Path, model: str, version: str) -> Path:
    return version_dir(store, model, version) / SIGNATURE


def artifact_path(store: str | Path, model: str, version: str) -> Path:
    return version_dir(store, model, version) / ARTIFACT


def signature_files(store: str | Path) -> dict[tuple[str, str], Path]:
    """``{(model, version): path}`` of every ``<model>/<version>/signature.json`` under the store."""
    store = Path(store)
    if not store.is_dir():
        return {}
    return {(p.parent.parent.name, p.parent.name): p for p in sorted(store.glob(f"*/*/{SIGNATURE}"))}


def fingerprint(store: str | Path) -> tuple:
    """Cheap change detector for a rescan: (path, mtime_ns, size) of every signature file."""
    out = []
    for key, p in signature_files(store).items():
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((key, st.st_mtime_ns, st.st_size))
    return tuple(out)

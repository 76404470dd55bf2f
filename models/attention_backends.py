"""The attention backends a model can run on, and which one ``auto`` picks; imports no JAX.

``"pallas"`` runs the kernels of ``pallas_kernels`` on the paged cache (``interpret=True`` off
GPU); ``"reference"`` gathers each sequence's blocks and runs the plain-JAX references (exact,
slow: tests, and checking the kernels inside a whole model). ``models.attention`` dispatches on
the name; the engine's configuration validates it against :data:`ATTENTION_BACKEND_CHOICES`.
"""

from __future__ import annotations

ATTENTION_BACKENDS: tuple[str, ...] = ("pallas", "reference")
# What ``--attention-backend`` accepts: ``auto`` resolves with ``resolve_attention_backend``.
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = ("auto", *ATTENTION_BACKENDS)


def check_attention_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`ATTENTION_BACKENDS`.

    Raises:
        ValueError: naming the value and the choices.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}"
        )
    return backend


def resolve_attention_backend(backend: str, platform: str) -> str:
    """The backend to run: ``auto`` is ``pallas`` on ``platform == "gpu"`` (JAX's
    ``default_backend()``) and ``reference`` elsewhere, where Pallas only interprets.

    Raises:
        ValueError: a name outside :data:`ATTENTION_BACKEND_CHOICES`.
    """
    if backend == "auto":
        return "pallas" if platform == "gpu" else "reference"
    return check_attention_backend(backend)

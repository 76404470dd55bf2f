"""Request fields -> ``StructuredOutputsParams`` (completions and chat share them).

vLLM 0.34's surface, one constraint per request:

- ``structured_outputs``: the ``StructuredOutputsParams`` fields as an object
  (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``,
  ``{"json_object": true}``, ``{"structural_tag": ...}``, plus ``disable_any_whitespace`` ...);
- the older aliases ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  and the top-level ``structural_tag``; ``guided_whitespace_pattern`` becomes
  ``whitespace_pattern`` (which the xgrammar backend refuses by name); ``guided_decoding_backend``
  may only name the engine's backend (``xgrammar`` / ``auto``): the backend is per engine;
- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``.

Two of these at once is a 400 naming the second; so is a malformed one. A constraint the
backend cannot compile is refused by the engine when the request is added; ``rename_error``
turns the engine's field name (``json``, ``regex``, ...) into the request field that carried it.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.param_errors import SamplingParamsError
from jaxpaged.structured_output.params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams

_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
# A request cannot pick the grammar backend: the engine's (--structured-outputs-config) serves
# every request, so a named backend would be silently overridden; only "auto" is accepted.
_BACKENDS = ("auto",)
# Field names the engine's errors use for a constraint (SamplingParamsError.parameter).
_ENGINE_FIELDS = {*STRUCTURED_OUTPUT_KINDS, "whitespace_pattern", "structured_outputs"}


def structured_outputs_from_request(request) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the request field that gave it (None, None: none).

    Raises:
        BadRequestError: two constraint fields, an unknown ``response_format`` type, a
            ``json_schema`` without ``schema``, a ``guided_decoding_backend`` other than the
            engine's, or fields ``StructuredOutputsParams`` refuses; ``param`` names the field.
    """
    sources: list[tuple[str, dict]] = []
    if request.structured_outputs is not None:
        if not isinstance(request.structured_outputs, dict):
            raise BadRequestError(
                "structured_outputs must be an object of StructuredOutputsParams fields",
                param="structured_outputs",
            )
        sources.append(("structured_outputs", dict(request.structured_outputs)))
    for name, kind in _ALIASES.items():
        value = getattr(request, name)
        if value is not None:
            sources.append((name, {kind: value}))
    fmt = _response_format(request.response_format)
    if fmt is not None:
        sources.append(("response_format", fmt))
    backend = request.guided_decoding_backend
    if backend is not None and backend not in _BACKENDS:
        raise BadRequestError(
            f"guided_decoding_backend must be one of {list(_BACKENDS)}: the backend is the "
            f"engine's, set by --structured-outputs-config; got {backend!r}",
            param="guided_decoding_backend",
        )
    if not sources:
        if request.guided_whitespace_pattern is not None:
            raise BadRequestError(
                "guided_whitespace_pattern needs a JSON constraint (guided_json, "
                "structured_outputs or response_format)",
                param="guided_whitespace_pattern",
            )
        return None, None
    if len(sources) > 1:
        first, second = sources[0][0], sources[1][0]
        raise BadRequestError(
            f"{second} cannot be combined with {first}: a request takes one structured-output "
            "constraint",
            param=second,
        )
    source, fields = sources[0]
    if request.guided_whitespace_pattern is not None:
        fields.setdefault("whitespace_pattern", request.guided_whitespace_pattern)
    known = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    known |= {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise BadRequestError(
            f"{source}.{unknown[0]} is not a structured-outputs field; known: {sorted(known)}",
            param=source,
        )
    try:
        return StructuredOutputsParams(**fields), source
    except SamplingParamsError as error:
        raise BadRequestError(f"{source}: {error}", param=_param(source, error)) from None


def _response_format(fmt) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequestError(
                "response_format json_schema needs json_schema.schema (a JSON schema object)",
                param="response_format",
            )
        return {"json": spec["schema"]}
    raise BadRequestError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _param(source: str, error) -> str:
    parameter = getattr(error, "parameter", None)
    if source == "structured_outputs" and parameter and parameter != "structured_outputs":
        return f"structured_outputs.{parameter}"
    if parameter == "whitespace_pattern" and source != "structured_outputs":
        return "guided_whitespace_pattern"
    return source


def rename_error(error: BaseException, source: str | None) -> BaseException:
    """An engine refusal of a constraint (``parameter`` = ``json``, ``regex``, ...) renamed to
    the request field that carried it; any other error unchanged."""
    parameter = getattr(error, "parameter", None)
    if source is None or parameter not in _ENGINE_FIELDS:
        return error
    return BadRequestError(str(error), param=_param(source, error))

"""The OpenAPI 3.1 description of the admin API, generated from the operation table and the
msgspec types of its bodies (``msgspec.json.schema_components``): what is served is what is
described, with no hand-kept second copy."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from .. import __version__
from ._api import Operation
from ._schemas import ErrorBody

_REF = "#/components/schemas/{name}"
_REASONS = {
    400: "Bad request: invalid_argument, invalid_name, malformed_json, offset_out_of_range",
    401: "Unauthorized: authentication_failed (a broker with --auth: no Authorization: Bearer "
    "token, or a bad one; details.reason says which)",
    403: "Forbidden: permission_denied (no access rule allows it)",
    404: "Not found: stream_not_found, subscription_not_found, segment_not_found, "
    "transaction_not_found",
    409: "Conflict: stream_exists, subscription_exists, group_active, transaction_aborted",
    413: "Request body over the limit: request_too_large",
}

#: a stream's scope and name and a subscription's name: a lower-case letter or digit, then
#: those and ``._-`` (slipstream/streams/_names.py); a transaction id: a number
_NAME = {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,63}$"}
_STREAM_NAME = "^[a-z0-9][a-z0-9._-]{0,63}/[a-z0-9][a-z0-9._-]{0,63}$"
_PATH_SCHEMAS: dict[str, dict[str, Any]] = {
    "scope": _NAME,
    "name": _NAME,
    "subscription": _NAME,
    "txn_id": {"type": "string", "pattern": "^[0-9]{1,18}$"},
    "token_id": {"type": "string", "pattern": "^[0-9a-f]{1,64}$"},
}


def openapi_document(operations: Sequence[Operation]) -> dict[str, Any]:
    kinds: list[Any] = [ErrorBody]
    for op in operations:
        if op.body is not None:
            kinds.append(op.body)
        if op.answer is not None:
            kinds.append(op.answer)
    schemas, components = msgspec.json.schema_components(kinds, ref_template=_REF)
    # described, not enforced by the decoder: the service's invalid_name says more
    components["CreateStream"]["properties"]["name"]["pattern"] = _STREAM_NAME
    schema_of = dict(zip(map(_key, kinds), schemas, strict=True))
    error = {"application/json": {"schema": schema_of[_key(ErrorBody)]}}
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": _PATH_SCHEMAS[name]}
            for name in re.findall(r"{(\w+)}", op.path)
        ]
        for param in op.query:
            schema: dict[str, Any] = {"type": param.kind}
            if param.enum:
                schema["enum"] = list(param.enum)
            parameters.append(
                {
                    "name": param.name,
                    "in": "query",
                    "required": False,
                    "description": param.description,
                    "schema": schema,
                }
            )
        responses: dict[str, Any] = {}
        if op.answer is None:
            responses[str(op.status)] = {"description": "Done"}
        else:
            responses[str(op.status)] = {
                "description": "OK",
                "content": {"application/json": {"schema": schema_of[_key(op.answer)]}},
            }
        # every operation answers 401 when the broker's authentication is on
        codes = set(op.errors) | {401} | ({400, 413} if op.body is not None else set())
        for code in sorted(codes):
            responses[str(code)] = {"description": _REASONS[code], "content": error}
        entry: dict[str, Any] = {
            "operationId": op.handler.__name__,
            "summary": op.summary,
            "description": (op.handler.__doc__ or "").strip(),
            "responses": responses,
        }
        if parameters:
            entry["parameters"] = parameters
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of[_key(op.body)]}},
            }
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "slipstream admin API",
            "version": __version__,
            "description": "Streams, events, subscriptions, transactions and the broker, "
            "served by the broker (docs/http-api.md). Every error is "
            '{"error": code, "message": ..., "details": {...}}.',
        },
        "paths": paths,
        "components": {"schemas": components},
    }


def _key(kind: Any) -> str:
    return repr(kind)

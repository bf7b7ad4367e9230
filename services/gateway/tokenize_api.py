"""vLLM's POST /tokenize and POST /detokenize on the gateway's HTTP port: thin routes over
fastdecode.gateway.tokenize, registered by OpenAIApp (whose error handlers answer them)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from fastdecode.gateway.text import check_params, tokenize_request
from fastdecode.gateway.tokenize import (
    DetokenizeBody,
    TokenizeBody,
    check_detokenize,
    leading_specials,
    tokenize_params,
    tokenize_response,
)
from fastdecode.runtime.errors import as_service_error

if TYPE_CHECKING:
    from services.gateway.front import OpenAIFront

log = logging.getLogger("fastdecode.gateway.http")

# outside /v1/ (vLLM's paths) but behind the token as /v1/ is (services/gateway/http_server.py)
AUTHENTICATED_PATHS = frozenset({"/tokenize", "/detokenize"})


class TokenizeRoutes:
    def __init__(self, api: OpenAIFront) -> None:
        self.api = api
        api.app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        api.app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, body: TokenizeBody) -> Response:
        """The ids a generation of this prompt or chat would be given."""
        api, core = self.api, self.api.core
        api.check_model(body.model)
        limits, tok = core.limits, core.tokenizer
        try:
            params = tokenize_params(
                body, api.template, api.template_error, core.model_id, limits.max_context
            )
            check_params(params, limits)
            specials = core.settings.chat_special_tokens
            ids, _ = await asyncio.to_thread(tokenize_request, params, tok, specials)
        except Exception as e:  # noqa: BLE001 - the template's InvalidInput and the like
            raise as_service_error(e, log) from None
        if leading_specials(body):
            ids = tok.encode("", True) + ids
        strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return JSONResponse(tokenize_response(ids, limits.max_context, strs))

    async def detokenize(self, body: DetokenizeBody) -> Response:
        """Token ids back to text (special tokens written out)."""
        core = self.api.core
        self.api.check_model(body.model)
        ids = check_detokenize(body, core.config.vocab_size, core.limits.max_context)
        text = await asyncio.to_thread(core.tokenizer.decode, ids, False)
        return JSONResponse({"prompt": text})

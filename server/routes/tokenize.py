"""POST /tokenize and /detokenize, in vLLM's request and response shapes: what the generation
routes would feed the model for a prompt or a conversation, and the text of token ids."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.errors import bad_request
from server.openapi import route_docs
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.responses import DetokenizeResponse, TokenizeResponse
from server.routes.common import read_request

router = APIRouter()


@router.post("/tokenize", **route_docs(TokenizeRequest, TokenizeResponse))
async def tokenize(request: Request):
    state, body = await read_request(request, TokenizeRequest)
    if body.messages is not None:
        prompt = await state.prompts.chat_prompt([m.to_template() for m in body.messages],
                                                 add_special_tokens=bool(body.add_special_tokens),
                                                 **body.template_options)
    else:
        prompt = await state.prompts.text_prompt(body.prompt, body.add_special_tokens is not False)
    ids = prompt.token_ids
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", **route_docs(DetokenizeRequest, DetokenizeResponse))
async def detokenize(request: Request):
    state, body = await read_request(request, DetokenizeRequest)
    vocab = len(state.tokenizer)  # the ids it can spell (a model's vocabulary may be padded past them)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad[0]}", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

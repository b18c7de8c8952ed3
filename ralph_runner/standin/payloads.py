"""The shapes of what the stand-in sends, as vLLM 0.32 sends them (field for field, in its
order): the bodies, chunks, items and errors of wire.py. The `None` fields are vLLM's own,
always null here; a strict client still finds them."""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: None
    code: int


class ErrorBody(TypedDict):
    """vLLM's ErrorResponse."""

    error: ErrorDetail


class Usage(TypedDict):
    """vLLM's UsageInfo; a whole body's also carries its (empty) details."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: NotRequired[None]
    completion_tokens_details: NotRequired[None]


# chat completions


class Function(TypedDict):
    name: str
    arguments: str


class ChatToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: Function


class ToolCalls(TypedDict, total=False):
    tool_calls: list[ChatToolCall]  # vLLM leaves an empty list out


class ChatMessage(ToolCalls):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    annotations: None
    audio: None
    function_call: None
    reasoning: None


class ChatChoice(TypedDict):
    index: int
    message: ChatMessage
    logprobs: None
    finish_reason: str
    stop_reason: None
    token_ids: None
    routed_experts: None


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    service_tier: None
    system_fingerprint: str
    usage: Usage
    prompt_logprobs: None
    prompt_token_ids: None
    prompt_text: None
    kv_transfer_params: None
    ec_transfer_params: None
    metrics: None


class FunctionDelta(TypedDict, total=False):
    name: str  # in a call's first delta
    arguments: str  # in the next ones


class ToolCallDelta(TypedDict):
    index: int
    id: NotRequired[str]  # the first delta of a call: its id, type and name
    type: NotRequired[Literal["function"]]
    function: FunctionDelta


class Delta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallDelta]


class ChunkChoice(TypedDict):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None
    stop_reason: NotRequired[None]  # the last chunk's
    token_ids: NotRequired[None]  # every chunk's but the first


class ChunkExtras(TypedDict, total=False):
    """What some chunks carry besides their choices: the first its prompt's (null) ids and
    text, the usage chunk its usage, the last one the fingerprint."""

    prompt_token_ids: None
    prompt_text: None
    usage: Usage
    system_fingerprint: str


class ChatCompletionChunk(ChunkExtras):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]


# completions


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: None
    prompt_logprobs: NotRequired[None]  # a whole body's


class CompletionEnvelope(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]


class CompletionChunk(CompletionEnvelope):
    usage: NotRequired[Usage]  # the usage chunk's


class Completion(CompletionEnvelope):
    service_tier: None
    system_fingerprint: None
    usage: Usage
    kv_transfer_params: None


# responses


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[object]
    logprobs: list[object] | None  # [] while streamed, null once done


class MessageItem(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: str
    content: list[OutputText]
    phase: None


class FunctionCallItem(TypedDict):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | FunctionCallItem


class InputTokensDetails(TypedDict):
    cached_tokens: int
    cache_write_tokens: int
    input_tokens_per_turn: list[int]
    cached_tokens_per_turn: list[int]


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int
    tool_output_tokens: int
    output_tokens_per_turn: list[int]
    tool_output_tokens_per_turn: list[int]


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class Response(TypedDict):
    """vLLM 0.32's ResponsesResponse; the request's own settings are echoed as it sent them."""

    id: str
    created_at: int
    incomplete_details: IncompleteDetails | None
    instructions: object
    metadata: object
    model: str
    object: Literal["response"]
    output: list[OutputItem]
    parallel_tool_calls: object
    temperature: object
    tool_choice: object
    tools: object
    top_p: object
    background: bool
    max_output_tokens: object
    max_tool_calls: None
    previous_response_id: object
    prompt: None
    reasoning: None
    service_tier: str
    status: str
    text: None
    top_logprobs: None
    truncation: str
    usage: ResponseUsage | None
    user: None
    presence_penalty: float
    frequency_penalty: float
    kv_transfer_params: None
    ec_transfer_params: None
    input_messages: None
    output_messages: None

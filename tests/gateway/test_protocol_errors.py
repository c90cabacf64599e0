"""Request models and the error shapes, without a worker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.errors import APIError, context_overflow, error_body, validation_message
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


def test_unknown_fields_are_kept_aside() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "frob": 1, "user": "u"}
    )
    assert req.model_extra == {"frob": 1}


def test_max_completion_tokens_preferred() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    )
    assert req.requested_max_tokens() == 5
    req = req.model_copy(update={"max_completion_tokens": 3})
    assert req.requested_max_tokens() == 3


def test_stop_strings() -> None:
    assert CompletionRequest(prompt="x").stop_strings() == []
    assert CompletionRequest(prompt="x", stop="a").stop_strings() == ["a"]
    assert CompletionRequest(prompt="x", stop=["a", "b"]).stop_strings() == ["a", "b"]


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="x").prompts() == ["x"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_include_usage_needs_stream() -> None:
    with pytest.raises(ValidationError, match="stream_options"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True})  # type: ignore[arg-type]
    req = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
    assert req.include_usage
    assert not CompletionRequest(prompt="x", stream=True).include_usage


def test_neutral_values_of_unsupported_features_pass() -> None:
    CompletionRequest(
        prompt="x", frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1, logit_bias={}
    )
    ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": "none",
            "response_format": {"type": "text"},
        }
    )


def test_content_parts_are_text() -> None:
    msg = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}
    )
    assert [p.text for p in msg.content or ()] == ["a", ""]  # type: ignore[union-attr]
    for part, why in [
        ({"type": "input_audio", "input_audio": {}}, "content part type 'input_audio'"),
        ({"type": "text"}, "a text part needs 'text'"),
    ]:
        with pytest.raises(ValidationError) as e:
            ChatMessage.model_validate({"role": "user", "content": [part]})
        message, param = validation_message(e.value.errors())
        assert why in message
        assert param == "content"  # "messages" once inside a request body


def test_lone_surrogates_are_refused() -> None:
    # What json.loads makes of "\ud800": not text a tokenizer or protobuf string can carry.
    for body in (
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"messages": [{"role": "user", "content": "x"}], "stop": ["\udfff"]},
    ):
        with pytest.raises(ValidationError, match="lone surrogate"):
            ChatCompletionRequest.model_validate(body)
    with pytest.raises(ValidationError, match="lone surrogate"):
        CompletionRequest.model_validate({"prompt": "a\ud800b"})
    # A pair is one character.
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "\U0001f600"}]})


def test_temperature_must_fit_float32() -> None:
    CompletionRequest(prompt="x", temperature=3.4e38)
    with pytest.raises(ValidationError, match="temperature"):
        CompletionRequest(prompt="x", temperature=1e39)  # would reach the worker as inf


def test_error_body_shape() -> None:
    assert error_body(400, "bad", param="n") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "n", "code": 400}
    }
    err = APIError(503, "busy", headers={"Retry-After": "2"})
    assert err.body()["error"]["type"] == "ServiceUnavailableError"
    assert err.headers == {"Retry-After": "2"}
    assert context_overflow(10, 8, 4).param == "messages"


def test_validation_message_names_the_param() -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "stop": [1]}
        )
    message, param = validation_message(e.value.errors())
    assert param == "stop"
    assert message.startswith("stop")
    json_err = [{"type": "json_invalid", "loc": ("body", 3), "msg": "x", "ctx": {"error": "E"}}]
    assert validation_message(json_err) == ("Invalid JSON body: E", None)
    model_err = [{"type": "value_error", "loc": ("body",), "msg": "Value error, nope"}]
    assert validation_message(model_err) == ("Value error, nope", None)

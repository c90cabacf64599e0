"""``SamplingParams.validate`` refuses what vLLM and OpenAI refuse, with messages fit for a
client (they become gRPC INVALID_ARGUMENT)."""

from __future__ import annotations

import pytest

from services.worker.request.request import SamplingParams

VOCAB = 100


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"presence_penalty": float("nan")}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\], got -2.01"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0.1"),
        (
            {"logit_bias": ((100, 1.0),)},
            r"logit_bias token ids out of vocabulary \[0, 100\): \[100\]",
        ),
        ({"logit_bias": ((-1, 1.0), (3, 2.0))}, r"out of vocabulary \[0, 100\): \[-1\]"),
        (
            {"logit_bias": ((5, 101.0),)},
            r"logit_bias values must be in \[-100, 100\], got \[\(5, 101.0\)\]",
        ),
        ({"logit_bias": ((5, float("nan")),)}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, r"logit_bias lists token ids more than once: \[5\]"),
    ],
)
def test_out_of_range_parameters_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields).validate(VOCAB)


def test_the_limits_themselves_are_accepted() -> None:
    SamplingParams(
        presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3, min_p=1.0,
        logit_bias=((0, -100.0), (99, 100.0)),
    ).validate(VOCAB)  # fmt: skip
    SamplingParams(repetition_penalty=5.0, min_p=0.0).validate(VOCAB)  # vLLM: any > 0

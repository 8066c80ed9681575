"""``POST /v1/responses``: OpenAI's Responses API over the chat completions machinery.

The request is written as a chat completion (``responses_request``) and answered by the same jobs; the answer is
read as a chat's (``responses.Answer``: its text, or with tools its calls) and written as a response object:
an ``output`` of a ``message`` item (one ``output_text`` part) or ``function_call`` items, ``status``
``completed``, or ``incomplete`` when ``max_output_tokens`` (or the context) ended it. Streamed, the typed events
OpenAI sends: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its part
or arguments and their deltas, ``...done``, and last ``response.completed`` (or ``response.incomplete``); a
request the server ends (shutdown) gets an ``error`` event and ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from oneblock.errors import InputError
from oneblock.serve.checks import ApiError
from oneblock.serve.handlers import Events, Service, body_refusal, error_response, failure, whole
from oneblock.serve.jobs import Delta, Done, Echoed, Failed, Job
from oneblock.serve.protocol import Request
from oneblock.serve.responses import Answer
from oneblock.serve.responses_request import ResponsesRequest, parse_responses, renamed
from oneblock.text.tokenizer import Tokenizer
from oneblock.web.body import parse_json, read_body


class ResponseAnswer(Answer):
    """A chat's ``Answer`` (one choice) written as a response object and its stream's events."""

    def __init__(self, request: Request, tokenizer: Tokenizer, asked: ResponsesRequest) -> None:
        super().__init__(request, tokenizer)
        self.asked = asked
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0

    def response(
        self, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object in a given state (``in_progress`` with no output yet, or finished)."""
        done = self.choices[0].done
        reason = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if done is not None:
            counts = self.usage()
            usage = {
                "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                "total_tokens": counts["total_tokens"],
                "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0},
            }  # fmt: skip
        return {
            "id": f"resp_{self.id}", "object": "response", "created_at": self.created_at, "status": status,
            "model": self.request.model, "output": output, "error": error, "incomplete_details": reason,
            **self.asked.echoed, "metadata": {}, "store": False, "truncation": "disabled", "usage": usage,
        }  # fmt: skip

    def status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def items(self) -> list[dict[str, Any]]:
        """The finished output: the calls, or the message with its text."""
        choice = self.choices[0]
        message = choice.message or {"content": "".join(choice.pieces)}
        calls = message.get("tool_calls")
        if calls:
            return [
                {"id": f"fc_{call['id'].removeprefix('call_')}", "type": "function_call", "status": "completed",
                 "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                for call in calls
            ]  # fmt: skip
        return [self.message(message.get("content") or "", self.status())]

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The message item: ``in_progress`` with no part yet (``text`` None), or its one ``output_text`` part."""
        content = [] if text is None else [self.part(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def whole(self) -> dict[str, Any]:
        return self.response(self.status(), self.items())

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, numbered in order."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        started = self.response("in_progress", [])
        events = [self.event(kind, response=started) for kind in ("response.created", "response.in_progress")]
        if self.request.tools is None:  # the text streams as it comes; with tools, the answer is read whole
            events += self._message_opened()
        return events

    def _message_opened(self) -> list[str]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
            self.event("response.content_part.added", **where, part=self.part("")),
        ]

    def delta(self, text: str) -> list[str]:
        """A piece of the text as it comes (none with tools: the answer is read whole, then sent in one piece)."""
        return [] if self.request.tools is not None else self._delta(text)

    def _delta(self, text: str) -> list[str]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_text.delta", **where, delta=text, logprobs=[])] if text else []

    def closing(self) -> list[str]:
        """The items' last events (with tools, each item whole), then ``response.completed`` or ``incomplete``."""
        items, status, events = self.items(), self.status(), []
        for index, item in enumerate(items):
            if item["type"] == "function_call":
                opened = {**item, "arguments": "", "status": "in_progress"}
                where = {"item_id": item["id"], "output_index": index}
                events += [
                    self.event("response.output_item.added", output_index=index, item=opened),
                    self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                ]
            else:
                text = item["content"][0]["text"]
                if self.request.tools is not None:
                    events += self._message_opened()
                    events += self._delta(text)
                where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
                events += [
                    self.event("response.output_text.done", **where, text=text, logprobs=[]),
                    self.event("response.content_part.done", **where, part=self.part(text)),
                ]
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.response(status, items))]

    def failed(self, error: ApiError) -> list[str]:
        return [
            self.event("error", code=error.code, message=error.message, param=None),
            self.event("response.failed", response=self.response(
                "failed", [], {"code": "server_error", "message": error.message})),
        ]  # fmt: skip


async def create_response(service: Service, request: HTTPRequest) -> Response:
    """``POST /v1/responses``: a response object, or its events with ``"stream": true``."""
    try:
        raw = await read_body(request, service.limits.max_body, seconds=service.limits.body_seconds)
        asked, parsed = await run_in_threadpool(_parse, service, raw)
        adapter = service.adapter(parsed.model)
    except ApiError as error:
        return error_response(renamed(error))
    except InputError as error:
        return error_response(body_refusal(error))
    except ClientDisconnect:
        return Response(status_code=499)
    events = Events()
    jobs = service.jobs(parsed, events, adapter)
    refusal = service.submit(jobs)
    if refusal is not None:
        return error_response(refusal)
    answer = ResponseAnswer(parsed, service.engine.tokenizer, asked)
    if parsed.stream:
        headers = {"Cache-Control": "no-store"}
        return StreamingResponse(_stream(answer, jobs, events), media_type="text/event-stream", headers=headers)
    return await whole(request, answer, jobs, events)


def _parse(service: Service, raw: bytes) -> tuple[ResponsesRequest, Request]:
    asked = parse_responses(parse_json(raw))
    return asked, service.check_completion(asked.chat, "chat")


async def _stream(answer: ResponseAnswer, jobs: list[Job], events: Events) -> AsyncIterator[str]:
    try:
        for line in answer.opening():
            yield line
        while True:
            item = await events.get()
            if item is None:
                break
            index, event = item
            if isinstance(event, Failed):
                for line in answer.failed(failure(event)):
                    yield line
                break
            if isinstance(event, Done):
                answer.finish(index, event)
                for line in answer.closing():
                    yield line
                break
            if isinstance(event, (Delta, Echoed)):
                answer.add(index, event)
                for line in answer.delta(event.text if isinstance(event, Delta) else ""):
                    yield line
    finally:
        for job in jobs:
            job.cancel()

"""Async CPU generation engine over a Hugging Face causal LM: token ids in, token ids + log-probs out.

Continuous batching: requests wait in a queue; a decode loop in a worker thread takes queued
requests (up to ``max_batch_size`` rows in flight), prefills them as one left-padded batch and
joins them to the rows already decoding (the two KV caches are left-padded to one length and
concatenated), then decodes one token for every row per step. A row is answered and dropped from
the batch (and its cache) the moment it finishes, and a request that arrives while others decode
joins at the next step instead of waiting for the longest row.

Per decode step and row, with ``z`` the model's last-position logits (float32):

- greedy (``temperature < 1e-5``): ``token = argmax z``;
- sampled: ``z' = z / temperature``, then top-k (``top_k > 0``) and top-p (``top_p < 1``) set the
  dropped logits to ``-inf``; ``token ~ softmax(z')`` from the request's own seeded generator, so a
  row's tokens do not depend on which other rows share its batch.

The returned log-prob of a token is, as in vLLM, ``log_softmax(z')[token]`` for
``logprobs_mode="processed_logprobs"`` (verl's default; greedy rows use ``z' = z``) and
``log_softmax(z)[token]`` for ``"raw_logprobs"``.

A row stops at the first of: an EOS / ``stop_token_ids`` token (kept in the output, unless
``ignore_eos`` for EOS), a ``stop`` string appearing in the decoded output (the tokens up to and
including the one that completed it are kept), ``max_tokens`` tokens, or an abort.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: vLLM's threshold below which a temperature means greedy decoding
GREEDY_TEMPERATURE_EPS = 1e-5
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")

# sampling keys verl or an agent loop may pass that change nothing here
_IGNORED_SAMPLING_KEYS = frozenset(
    {"logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"}
)


@dataclass(frozen=True)
class SamplingOptions:
    """One request's sampling parameters, named as in vLLM's ``SamplingParams``.

    ``top_k <= 0`` disables top-k (vLLM uses -1); ``seed=None`` lets the engine derive one.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @classmethod
    def from_vllm_params(cls, params: dict[str, Any], max_tokens: int) -> SamplingOptions:
        """Build from the ``sampling_params`` dict verl's agent loops send to a rollout server.

        ``max_tokens`` is the already-bounded budget; unknown keys raise, so a parameter this
        engine would silently ignore is caught (``n`` must be 1; presence/frequency penalties 0).
        """
        params = dict(params)
        for key in ("max_tokens", "max_new_tokens"):
            params.pop(key, None)
        if int(params.pop("n", 1)) != 1:
            raise ValueError("the hf rollout engine answers one sample per request (n must be 1)")
        for key in ("presence_penalty", "frequency_penalty"):
            if float(params.pop(key, 0.0) or 0.0) != 0.0:
                raise ValueError(f"the hf rollout engine does not implement {key}")
        stop = params.pop("stop", None) or ()
        if isinstance(stop, str):
            stop = (stop,)
        kwargs: dict[str, Any] = {
            "temperature": float(params.pop("temperature", 1.0)),
            "top_p": float(params.pop("top_p", 1.0)),
            "top_k": int(params.pop("top_k", -1)),
            "min_tokens": int(params.pop("min_tokens", 0) or 0),
            "repetition_penalty": float(params.pop("repetition_penalty", 1.0) or 1.0),
            "stop": tuple(str(s) for s in stop if s),
            "stop_token_ids": tuple(int(t) for t in (params.pop("stop_token_ids", None) or ())),
            "ignore_eos": bool(params.pop("ignore_eos", False)),
            "seed": None if params.get("seed") is None else int(params.pop("seed")),
        }
        params.pop("seed", None)
        unknown = sorted(k for k in params if k not in _IGNORED_SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"the hf rollout engine does not support sampling params {unknown}")
        return cls(max_tokens=max_tokens, **kwargs)


@dataclass
class GenerationOutput:
    """Generated token ids, the log-prob of each, and why generation ended (stop | length | abort)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str


@dataclass
class _Request:
    prompt_ids: list[int]
    options: SamplingOptions
    generator: torch.Generator
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def resolve(self) -> None:
        out = GenerationOutput(list(self.token_ids), list(self.log_probs), self.finish_reason or "abort")

        def _set() -> None:
            if not self.future.done():
                self.future.set_result(out)

        self.loop.call_soon_threadsafe(_set)


@dataclass
class _Batch:
    """Rows decoding together: their KV cache, attention mask (left-padded), next positions, next logits."""

    rows: list[_Request]
    cache: Any
    attention_mask: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor

    @property
    def mergeable(self) -> bool:
        """True when the cache is made of plain dynamic layers whose tensors can be padded and joined."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(
            type(layer).__name__ == "DynamicLayer" and getattr(layer, "keys", None) is not None for layer in layers
        )

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (a CPU tensor); drop cache columns that are padding for every kept row."""
        on_device = index.to(self.attention_mask.device)  # the same tensor on CPU
        self.cache.reorder_cache(on_device)
        self.rows = [self.rows[int(i)] for i in index]
        self.attention_mask, self.next_pos, self.logits = (
            self.attention_mask[on_device],
            self.next_pos[on_device],
            self.logits[index],
        )
        lead = int(self.attention_mask.any(dim=0).int().argmax())
        if lead > 0 and self.mergeable:
            self.attention_mask = self.attention_mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def merge(self, other: _Batch) -> _Batch:
        """Append ``other``'s rows: both caches and masks are left-padded to one length, then stacked."""
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)], dim=0)
        self.attention_mask = torch.cat(
            [_pad_left(self.attention_mask, width, 1), _pad_left(other.attention_mask, width, 1)], dim=0
        )
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows
        return self


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class HFGenerationEngine:
    """Batched, KV-cached sampling from a transformers causal LM on CPU (see the module docstring).

    Args:
        model: a causal LM whose forward takes ``input_ids, attention_mask, position_ids,
            past_key_values, use_cache`` (every transformers decoder-only LM does).
        tokenizer: needed only for ``stop`` strings (decoding the output).
        eos_token_ids: ids that end a row unless the request sets ``ignore_eos``.
        max_model_len: prompt + output tokens may not exceed this.
        max_batch_size: most rows decoded together.
        batch_wait_s: after the first queued request, wait this long for others to join its batch.
        seed: base of the per-request seeds of requests that carry none.
        device: where the model runs (``cpu``, ``cuda``, ``cuda:1``); sampling and log-probs are
            computed on the CPU from the last position's logits either way (per-request CPU
            generators), so a row's tokens depend on the device only through the forward pass.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        logprobs_mode: str = "processed_logprobs",
        seed: int = 0,
        pad_token_id: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()  # a no-op for a model already there
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len)
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = float(batch_wait_s)
        self.logprobs_mode = logprobs_mode
        self.seed = int(seed)
        self.pad_token_id = int(pad_token_id)
        self._request_counter = itertools.count()
        self._pending: collections.deque[_Request] = collections.deque()
        self._pending_lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._serve_task: asyncio.Task | None = None
        self._model_lock = threading.Lock()  # the decode loop or a weight load, never both
        self._abort = threading.Event()
        self._hold_admission = threading.Event()  # set while a weight load waits for the loop to end
        self._admission_open = asyncio.Event()
        self._admission_open.set()
        self._in_flight = 0
        #: sizes of the groups of requests prefilled together (tests and metrics)
        self.batch_sizes: list[int] = []
        #: most rows ever decoding at once
        self.peak_rows = 0

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: str | torch.dtype = torch.float32,
        random_init: bool = False,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        **engine_kwargs: Any,
    ) -> HFGenerationEngine:
        """Load ``path`` (weights, or only its config when ``random_init``) and its tokenizer; the
        model moves to ``engine_kwargs["device"]`` (default ``cpu``)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if random_init:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        engine_kwargs.setdefault(
            "eos_token_ids",
            default_eos_token_ids(model.config, getattr(model, "generation_config", None), tokenizer),
        )
        engine_kwargs.setdefault("max_model_len", int(getattr(model.config, "max_position_embeddings", 4096)))
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            engine_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
        return cls(model, tokenizer, **engine_kwargs)

    # --- public async API -----------------------------------------------------------------

    def max_new_tokens(self, prompt_len: int, requested: int) -> int:
        """``requested`` clamped to ``[1, max_model_len - prompt_len]``; raises when no room is left."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt length ({prompt_len}) leaves no room to generate within max_model_len ({self.max_model_len})"
            )
        return max(1, min(int(requested), room))

    async def generate(self, prompt_ids: Sequence[int], options: SamplingOptions) -> GenerationOutput:
        """Queue one request and wait for its output (``options.max_tokens`` is bounded by the context)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        budget = self.max_new_tokens(len(prompt), options.max_tokens)
        if budget != options.max_tokens:
            options = dataclasses.replace(options, max_tokens=budget)
        if options.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; build the engine with one")
        await self._admission_open.wait()
        self._ensure_serving()
        assert self._wakeup is not None
        seed = options.seed if options.seed is not None else self.seed * 1_000_003 + next(self._request_counter)
        loop = asyncio.get_running_loop()
        request = _Request(
            prompt_ids=prompt,
            options=options,
            generator=torch.Generator().manual_seed(seed),
            future=loop.create_future(),
            loop=loop,
        )
        self._in_flight += 1
        try:
            with self._pending_lock:
                self._pending.append(request)
            self._wakeup.set()
            return await request.future
        finally:
            self._in_flight -= 1

    async def abort_all(self, keep_closed: bool = True) -> int:
        """End every queued and running request now (finish reason ``abort``, tokens so far kept).

        With ``keep_closed`` new requests wait until :meth:`resume`. Returns the number aborted.
        """
        if keep_closed:
            self._admission_open.clear()
        aborted = self._in_flight
        self._abort.set()
        while self._in_flight > 0:
            await asyncio.sleep(0.005)
        self._abort.clear()
        return aborted

    def resume(self) -> None:
        """Admit requests again after :meth:`abort_all`."""
        self._admission_open.set()

    async def wait_idle(self) -> None:
        """Return once no request is queued or running."""
        while self._in_flight > 0:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Abort what is in flight and stop the serving task."""
        await self.abort_all(keep_closed=False)
        if self._serve_task is not None:
            self._serve_task.cancel()
            await asyncio.gather(self._serve_task, return_exceptions=True)
            self._serve_task = None

    # --- weights --------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters/buffers by name; returns how many were copied.

        Rows already decoding finish on the old weights (no new request joins them meanwhile);
        queued requests then run on the new ones. Unknown names or shape mismatches raise (a
        silent partial update would make the rollout policy differ from the trained one).
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        copied = 0
        self._hold_admission.set()
        try:
            self._model_lock.acquire()
        finally:
            self._hold_admission.clear()
        try:
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"weight {name!r} does not exist in the rollout model {type(self.model).__name__}")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                copied += 1
        finally:
            self._model_lock.release()
        return copied

    # --- serving loop ---------------------------------------------------------------------

    def _ensure_serving(self) -> None:
        if self._serve_task is None or self._serve_task.done():
            self._wakeup = asyncio.Event()
            self._serve_task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            if self.batch_wait_s > 0:  # let requests sent together be prefilled together
                await asyncio.sleep(self.batch_wait_s)
            rows: list[_Request] = []
            try:
                await asyncio.to_thread(self._decode_loop, rows)
            except Exception as exc:  # noqa: BLE001 - every waiter gets the error, the loop lives on
                logger.exception("hf rollout engine: decode loop failed with %d rows", len(rows))
                for request in rows:
                    if not request.future.done():
                        request.loop.call_soon_threadsafe(request.future.set_exception, exc)

    def _take_pending(self, room: int) -> list[_Request]:
        with self._pending_lock:
            taken = []
            while self._pending and len(taken) < room:
                taken.append(self._pending.popleft())
            return taken

    # --- the decode loop, in a worker thread ------------------------------------------------

    @torch.no_grad()
    def _decode_loop(self, rows: list[_Request]) -> None:
        """Decode until no row is active and nothing is queued; ``rows`` mirrors the active rows."""
        with self._model_lock:
            batch: _Batch | None = None
            while True:
                n_active = len(batch.rows) if batch is not None else 0
                admit = not self._hold_admission.is_set() and (batch is None or batch.mergeable)
                new = self._take_pending(self.max_batch_size - n_active) if admit else []
                if new and self._abort.is_set():
                    for request in new:
                        request.finish_reason = "abort"
                        request.resolve()
                    new = []
                if new:
                    self.batch_sizes.append(len(new))
                    fresh = self._prefill(new)
                    batch = fresh if batch is None else batch.merge(fresh)
                    rows[:] = batch.rows
                    self.peak_rows = max(self.peak_rows, len(batch.rows))
                if batch is None:
                    return
                tokens, log_probs = self._sample(batch.logits, batch.rows)
                keep = []
                for j, request in enumerate(batch.rows):
                    request.token_ids.append(int(tokens[j]))
                    request.log_probs.append(float(log_probs[j]))
                    request.finish_reason = self._finish_reason(request)
                    if request.finish_reason is None:
                        keep.append(j)
                    else:
                        request.resolve()
                if not keep:
                    batch = None
                    rows.clear()
                    continue
                if len(keep) < len(batch.rows):
                    index = torch.tensor(keep, dtype=torch.long)
                    batch.select(index)
                    tokens = tokens[index]
                    rows[:] = batch.rows
                batch.attention_mask = torch.cat(
                    [batch.attention_mask, batch.attention_mask.new_ones((len(batch.rows), 1))], dim=1
                )
                batch.logits = self._forward(
                    tokens[:, None].to(self.device), batch.attention_mask, batch.next_pos[:, None], batch.cache
                )
                batch.next_pos = batch.next_pos + 1

    def _prefill(self, requests: list[_Request]) -> _Batch:
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, request in enumerate(requests):
            n = len(request.prompt_ids)
            input_ids[i, width - n :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            attention_mask[i, width - n :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)  # no-ops on CPU
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        return _Batch(list(requests), cache, attention_mask, position_ids[:, -1] + 1, logits)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float().to("cpu")  # sampled on the CPU; a no-op there

    def _finish_reason(self, request: _Request) -> str | None:
        options, token = request.options, request.token_ids[-1]
        if self._abort.is_set():
            return "abort"
        if (token in self.eos_token_ids and not options.ignore_eos) or token in options.stop_token_ids:
            return "stop"
        if options.stop and len(request.token_ids) >= options.min_tokens and self._completes_stop_string(request):
            return "stop"
        if len(request.token_ids) >= options.max_tokens:
            return "length"
        return None

    def _completes_stop_string(self, request: _Request) -> bool:
        """True when the newest token completed one of the request's stop strings."""
        stops = request.options.stop
        tail = max(len(s) for s in stops) + 4  # every token decodes to >= 1 char (bytes merge within 4)
        text = self.tokenizer.decode(request.token_ids[-tail:], skip_special_tokens=False)
        prev = self.tokenizer.decode(request.token_ids[-tail:-1], skip_special_tokens=False)
        return any(s in text and s not in prev for s in stops)

    def _sample(self, logits: torch.Tensor, rows: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row; return the tokens and their log-probs (module docstring)."""
        raw_logp = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        greedy = torch.tensor([r.options.greedy for r in rows])
        temperature = torch.tensor([1.0 if r.options.greedy else r.options.temperature for r in rows])
        scaled = logits / temperature[:, None]
        top_k = torch.tensor([0 if r.options.greedy else max(r.options.top_k, 0) for r in rows])
        top_p = torch.tensor([1.0 if r.options.greedy else r.options.top_p for r in rows])
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = _top_k_top_p(scaled, top_k, top_p)
        proc_logp = torch.log_softmax(scaled, dim=-1)
        tokens = scaled.argmax(dim=-1)
        for i, request in enumerate(rows):
            if not bool(greedy[i]):
                probs = proc_logp[i].exp()
                tokens[i] = torch.multinomial(probs, 1, generator=request.generator)[0]
        source = proc_logp if self.logprobs_mode == "processed_logprobs" else raw_logp
        return tokens, source.gather(1, tokens[:, None])[:, 0]

    def _apply_penalties(self, logits: torch.Tensor, rows: list[_Request]) -> torch.Tensor:
        """Repetition penalty over prompt + output (as vLLM/HF) and min_tokens masking of stop ids."""
        needs = [
            i
            for i, r in enumerate(rows)
            if r.options.repetition_penalty != 1.0 or len(r.token_ids) < r.options.min_tokens
        ]
        if not needs:
            return logits
        logits = logits.clone()
        for i in needs:
            options = rows[i].options
            if options.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(rows[i].prompt_ids) | set(rows[i].token_ids)), dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / options.repetition_penalty, vals * options.repetition_penalty
                )
            if len(rows[i].token_ids) < options.min_tokens:
                banned = set(options.stop_token_ids) | (set() if options.ignore_eos else set(self.eos_token_ids))
                if banned:
                    logits[i, torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
        return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (k <= 0: off) then top-p (1.0: off) filtering; dropped logits become -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop = (before >= top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def default_eos_token_ids(*sources: Any) -> set[int]:
    """Union of the ``eos_token_id`` (int or list) of each source: model config, generation config, tokenizer."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set, frozenset)) else [value]))
    return ids

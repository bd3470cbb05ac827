"""THE mapping table: every request field -> what TensorRT-LLM does with it, per API generation.

Each row names a wire field of ``/v1/completions`` (chat's fields map onto them: ``CHAT_FIELDS``) and,
for each generation, whether it is passed
to TensorRT-LLM natively, done by our serving layer ("ours": stop strings, detokenization, echo,
FIM prompt building…), refused with a 400, or conditional on how the engine was built/started.
``refusals()`` evaluates the same rows against a concrete request and the probed ``ApiFeatures``;
``render_markdown()`` turns the rows into the table in ``docs/deploy.md`` (a test keeps the two
equal). Nothing here imports ``tensorrt_llm`` or torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trtserver.engine.base import GenerationRequest, Priority
from trtserver.engine.trtllm.version import ApiFeatures, Generation

if TYPE_CHECKING:
    from trtserver.guided import GuideSpec

NATIVE_GUIDE_KINDS = frozenset({"json", "json_object", "regex", "grammar"})


class Kind(str, enum.Enum):
    NATIVE = "native"
    OURS = "ours"
    COND = "conditional"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Cell:
    kind: Kind
    note: str = ""

    def render(self) -> str:
        return f"{self.kind.value}: {self.note}" if self.note else self.kind.value


def N(note: str = "") -> Cell:  # noqa: N802 - table shorthand
    return Cell(Kind.NATIVE, note)


def O(note: str = "") -> Cell:  # noqa: N802,E743 - table shorthand
    return Cell(Kind.OURS, note)


def C(note: str) -> Cell:  # noqa: N802 - table shorthand
    return Cell(Kind.COND, note)


def R(note: str) -> Cell:  # noqa: N802 - table shorthand
    return Cell(Kind.REFUSED, note)


Check = Callable[[GenerationRequest, ApiFeatures], "str | None"]


@dataclass(frozen=True, slots=True)
class Rule:
    field: str
    """Wire field name(s); the first is the ``param`` of a refusal."""
    cells: tuple[Cell, Cell, Cell, Cell]
    """In ``GENERATIONS`` order."""
    check: Check | None = None
    """Reason to refuse this request on these features, or None."""

    @property
    def param(self) -> str:
        return self.field.split(" ")[0].split("/")[0]

    def cell(self, generation: Generation) -> Cell:
        return self.cells[GENERATIONS.index(generation)]


GENERATIONS = (Generation.V1_ENGINE, Generation.V1_PYTORCH, Generation.V0, Generation.JETSON)


# --- what a GenerationRequest asks for -------------------------------------------------------------

def guide_of(request: GenerationRequest) -> tuple[GuideSpec | None, str | None]:
    """The request's guide spec and backend name, when the serving layer passed them.

    ``GenerationRequest`` carries only the compiled ``GuidedDecoder``; native xgrammar needs the spec
    itself, read from ``request.guide_spec``/``guide_backend`` or the decoder's ``spec``/``backend``.
    """
    spec = getattr(request, "guide_spec", None) or getattr(request.guided, "spec", None)
    backend = getattr(request, "guide_backend", None) or getattr(request.guided, "backend", None)
    return spec, backend


def native_guide(request: GenerationRequest, f: ApiFeatures) -> bool:
    """Guided decoding goes to TRT-LLM's own xgrammar (GuidedDecodingParams)."""
    if request.guided is None or not f.has_guided_params or f.guided_backend != "xgrammar":
        return False
    spec, backend = guide_of(request)
    return spec is not None and backend in (None, "xgrammar") and spec.kind in NATIVE_GUIDE_KINDS


def needs_logits_processor(request: GenerationRequest, f: ApiFeatures) -> bool:
    """Our per-request processor is needed (plugin processors, non-native guides, no embedding_bias)."""
    s = request.sampling
    bias = bool(s.logit_bias) or s.allowed_token_ids is not None
    return (bool(request.logits_processors) or (request.guided is not None and not native_guide(request, f))
            or (bias and "embedding_bias" not in f.sampling_fields))


def _is_beam(r: GenerationRequest) -> bool:
    return r.sampling.use_beam_search


def logprobs_without_streaming_abort(f: ApiFeatures) -> bool:
    """#10810: aborting a streaming request with gathered logits crashes the TRT backend (1.1, 1.2rc7)."""
    return f.trt_backend and f.gather_generation_logits and f.has_abort


# --- checks ----------------------------------------------------------------------------------------

def _check_min_p(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.sampling.min_p and "min_p" not in f.sampling_fields:
        return f"TensorRT-LLM {f.version} has no min_p sampling (it is there by 1.0)"
    return None


def _check_bias(r: GenerationRequest, f: ApiFeatures) -> str | None:
    s = r.sampling
    if (s.logit_bias or s.allowed_token_ids is not None) and "embedding_bias" not in f.sampling_fields \
            and not f.dynamic_logits_processor:
        return f"TensorRT-LLM {f.version} has neither embedding_bias nor per-request logits processors"
    return None


def _check_logprobs(r: GenerationRequest, f: ApiFeatures) -> str | None:
    k = r.sampling.logprobs
    if k is None:
        return None
    if "logprobs" not in f.sampling_fields:
        if k > 0 and not f.logits_logprobs:
            return (f"top alternatives (logprobs > 0) on TensorRT-LLM {f.version} are computed from generation "
                    "logits: they need an engine built with gather_generation_logits "
                    "(trtllm-build --gather_generation_logits)")
        if "return_log_probs" not in f.sampling_fields:
            return f"TensorRT-LLM {f.version} cannot return logprobs"
        return None
    if f.trt_backend and not f.gather_generation_logits:
        if k > 0 or "_return_log_probs" not in f.sampling_fields:
            return ("top logprobs on a TensorRT engine need gather_generation_logits at start (server option "
                    "trtllm_gather_generation_logits)" + ("; only logprobs=0 is available" if k > 0 and
                                                          "_return_log_probs" in f.sampling_fields else ""))
    if f.generation is Generation.V1_PYTORCH and k > 0 and f.release < (1, 1, 0):
        return (f"TensorRT-LLM {f.version}'s PyTorch backend returns only the sampled token's logprob "
                "(logprobs=0), no top alternatives")
    return None


def _check_prompt_logprobs(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.sampling.prompt_logprobs is None:
        return None
    if "return_context_logits" not in f.sampling_fields:
        return f"TensorRT-LLM {f.version} cannot return context logits, from which prompt logprobs are computed"
    if f.trt_backend and not f.build.gather_context_logits:
        return ("prompt logprobs (echo with logprobs, loglikelihood) need an engine built with "
                "gather_context_logits; rebuild with `trtserver build --trtllm-gather-context-logits`")
    return None


def _check_n(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.n > 1 and not _is_beam(r) and not f.multiple_sequences:
        return f"TensorRT-LLM {f.version} cannot sample several sequences per prompt (n/best_of came in 0.15)"
    return None


def _check_beam(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if not _is_beam(r):
        return None
    if "use_beam_search" not in f.sampling_fields and "beam_width" not in f.sampling_fields:
        return f"TensorRT-LLM {f.version} has no beam search in its LLM API"
    if not f.trt_backend and f.max_beam_width < 2:
        return ("beam search on TensorRT-LLM's PyTorch backend needs the LLM started for it: "
                "server option trtllm_max_beam_width ≥ n")
    if r.n > f.max_beam_width:
        started = "built" if f.trt_backend else "started"
        return f"the engine was {started} with max_beam_width={f.max_beam_width}; asked for {r.n} beams"
    return None


def _check_priority(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.priority != Priority.NORMAL and not f.priority:
        return f"request priority reaches TensorRT-LLM's scheduler only from 1.4; this is {f.version}"
    return None


def _check_adapter(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.adapter is None:
        return None
    if not f.lora:
        return f"TensorRT-LLM {f.version} has no LoRA in its LLM API (lora_request came in 0.14)"
    if f.trt_backend and not f.build.lora_plugin:
        return "the TensorRT engine was not built with the LoRA plugin (trtllm-build --lora_plugin)"
    if not f.lora_enabled:
        return "no adapters directory is configured (server option adapters_dir)"
    return None


def _check_guided(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.guided is None or native_guide(r, f):
        return None
    if not f.dynamic_logits_processor:
        spec, backend = guide_of(r)
        if f.has_guided_params:
            return (f"TensorRT-LLM {f.version} guides only through its own xgrammar backend "
                    f"(server started with guided backend {f.guided_backend!r}; request backend {backend!r}, "
                    f"kind {getattr(spec, 'kind', None)!r})")
        return f"TensorRT-LLM {f.version} has no guided decoding and no per-request logits processors"
    if _is_beam(r):
        return "guided decoding through a logits processor needs beam width 1"
    return None


def _check_processors(r: GenerationRequest, f: ApiFeatures) -> str | None:
    if r.logits_processors and not f.dynamic_logits_processor:
        return f"TensorRT-LLM {f.version} has no per-request logits processors (came in 0.19)"
    if r.logits_processors and _is_beam(r):
        return "logits processors need beam width 1"
    return None


# --- the table -------------------------------------------------------------------------------------

_ALL_OURS = (O(), O(), O(), O())
_IGNORE_EOS_STOPS = "stop_token_ids still stop (ours too: main sends no stop words with it)"

RULES: tuple[Rule, ...] = (
    Rule("prompt", (N("token ids as prompt_token_ids"),) * 4),
    Rule("max_tokens", (N("always set (TRT-LLM's default is 32); 0 → 1, then dropped"),
                        N("max_tokens, always set"), N("max_tokens, always set"),
                        N("max_tokens (or max_new_tokens), always set"))),
    Rule("temperature / top_p / top_k", (N("greedy (temperature 0) → top_k=1"),) * 4),
    Rule("min_p", (N(), N(), C("where SamplingParams has min_p (none in 0.12–0.18; there by 1.0)"),
                   R("no min_p")), _check_min_p),
    Rule("seed", (N("always set: a fresh random seed when unset (TRT-LLM's default seed is 0)"),) * 3
         + (N("seed (or random_seed), always set"),)),
    Rule("frequency_penalty / presence_penalty / repetition_penalty", (N(),) * 4),
    Rule("min_tokens", (N(), N(), N(), N("min_tokens (or min_length)"))),
    Rule("ignore_eos", (N(_IGNORE_EOS_STOPS), N(_IGNORE_EOS_STOPS),
                        N("0.15+; before: end_id=-1 (unverified in C++)"), N("end_id=-1 (unverified in C++)"))),
    Rule("stop_token_ids", (N("plus extra EOS ids"),) * 3
         + (N("stop_token_ids where the wheel has it, else ours: we stop reading (the GPU runs on)"),)),
    Rule("logit_bias / allowed_token_ids", (N("embedding_bias ([vocab] fp32; allowed ids: -inf elsewhere)"),)
         * 3
         + (C("embedding_bias where the wheel has it, else refused"),), _check_bias),
    Rule("logprobs", (C("0: sampled-token logprob (_return_log_probs); "
                        "≥1 needs trtllm_gather_generation_logits"),
                      N("1.0: 0 only (the sampled token's logprob); 1.1+: top-k"),
                      C("0.20+: as 1.x; before: 0 is return_log_probs, ≥1 is computed by us from "
                        "generation_logits of an engine built with gather_generation_logits"),
                      C("0 is return_log_probs; ≥1 is computed by us from generation_logits of an engine "
                        "built with gather_generation_logits")), _check_logprobs),
    Rule("prompt_logprobs / echo+logprobs / loglikelihood",
         (C("return_context_logits, scored by us; engine built with gather_context_logits"),
          N("return_context_logits, scored by us"),
          C("return_context_logits, scored by us; engine built with gather_context_logits"),
          C("return_context_logits, scored by us; engine built with gather_context_logits")),
         _check_prompt_logprobs),
    Rule("n / best_of", (N("n=best_of=sequences; ranking is ours"), N("n=best_of"), C("0.15+"),
                         R("no n/best_of on the Jetson branch")), _check_n),
    Rule("use_beam_search / length_penalty / early_stopping",
         (C("engine max_beam_width ≥ n"),
          C("LLM started with max_beam_width ≥ n (server option trtllm_max_beam_width; 1.0: with the "
            "TRT-LLM sampler, no overlap scheduler, no CUDA graphs)"),
          C("engine max_beam_width ≥ n"), C("beam_width; engine max_beam_width ≥ n")), _check_beam),
    Rule("priority / service_tier", (C("generate_async(priority=) from 1.4; else refused"),
                                     C("generate_async(priority=) from 1.4; else refused"),
                                     R("no priority before 1.4"), R("no priority before 1.4")),
         _check_priority),
    Rule("peft", (C("LoRARequest from adapters_dir; engine built with --lora_plugin"),
                  C("LoRARequest from adapters_dir"), C("0.14+; engine built with --lora_plugin"),
                  R("no LoRA in the LLM class")), _check_adapter),
    Rule("guided_json / guided_regex / guided_choice / guided_grammar / guided_whitespace_pattern / "
         "guided_decoding_backend / structured_outputs / response_format",
         (N("xgrammar GuidedDecodingParams when started with it and the request's backend is xgrammar; "
            "otherwise our guide through a per-request logits processor"),
          N("as for the TensorRT engine"),
          C("0.19+: as 1.x; 0.16–0.18: native xgrammar only"),
          R("no guided decoding, no per-request logits processors")), _check_guided),
    Rule("logits_processors (plugins)", (N("per-request logits_processor (picklable, on TRT-LLM's stream)"),
                                         N("per-request logits_processor"), C("0.19+"),
                                         R("no per-request logits processors")), _check_processors),
    Rule("stop / include_stop_str_in_output", (O("text.py; the engine request is aborted on a match"),) * 3
         + (O("text.py; no abort: we stop reading, the GPU runs on to max_tokens"),)),
    Rule("echo", _ALL_OURS),
    Rule("suffix", (O("FIM prompt built before tokenization"),) * 4),
    Rule("stream / stream_options", (O("the engine always streams deltas to us"),) * 4),
    Rule("skip_special_tokens / spaces_between_special_tokens", (O("we send detokenize=False"),) * 4),
    Rule("add_special_tokens / truncate_prompt_tokens", (O("at tokenization"),) * 4),
    Rule("bad_words", _ALL_OURS),
    Rule("model / user / request_id / log_prompt / extra_body", _ALL_OURS),
    Rule("return_tokens_as_token_ids / return_token_ids", _ALL_OURS),
)

# /v1/chat/completions: the template is rendered by trtserver, so TensorRT-LLM gets token ids exactly as for
# /v1/completions; chat's own fields become these completions fields, and then follow their rows above
CHAT_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("messages (+ tools, documents, chat_template_kwargs)", "prompt",
     "rendered with the model's chat template by trtserver; TensorRT-LLM sees prompt token ids"),
    ("max_completion_tokens / max_tokens", "max_tokens", ""),
    ("logprobs + top_logprobs", "logprobs", "logprobs=true with top_logprobs=k is logprobs k (0 without it)"),
    ("tool_choice / response_format", "guided_json / response_format",
     "a forced tool call or a JSON response format becomes a guide"),
    ("stop, seed, n, temperature, top_p, penalties, logit_bias and the vLLM extensions", "the same field", ""),
)

ABORT_NOTES: dict[Generation, str] = {
    Generation.V1_ENGINE: "RequestOutput.abort() (C++ cancelRequest); a request with logprobs on an engine "
                          "started with gather_generation_logits is not streamed and never aborted "
                          "(TensorRT-LLM #10810 crash): we stop reading it",
    Generation.V1_PYTORCH: "RequestOutput.abort()",
    Generation.V0: "RequestOutput.abort() from 0.19; before, we stop reading and the GPU runs to max_tokens",
    Generation.JETSON: "none: we stop reading; the GPU keeps generating until max_tokens",
}


def refusals(request: GenerationRequest, features: ApiFeatures) -> list[tuple[str, str]]:
    """``(param, reason)`` for every part of ``request`` this TensorRT-LLM cannot serve."""
    found = []
    for rule in RULES:
        if rule.check is not None:
            reason = rule.check(request, features)
            if reason is not None:
                found.append((rule.param, reason))
    return found


def render_markdown() -> str:
    """The table for docs/deploy.md, between the BEGIN/END markers."""
    head = "| request field | " + " | ".join(g.label for g in GENERATIONS) + " |"
    lines = [head, "|" + "---|" * (len(GENERATIONS) + 1)]
    for rule in RULES:
        cells = " | ".join(c.render() for c in rule.cells)
        lines.append(f"| `{rule.field}` | {cells} |")
    notes = " | ".join(ABORT_NOTES[g] for g in GENERATIONS)
    lines.append(f"| abort (client gone, stop string) | {notes} |")
    lines += ["", "Chat completions (`/v1/chat/completions`) fields map onto the rows above:", "",
              "| chat field | maps like | note |", "|---|---|---|"]
    lines += [f"| `{chat}` | `{completions}` | {note} |" for chat, completions, note in CHAT_FIELDS]
    return "\n".join(lines) + "\n"


DOC_BEGIN = "<!-- BEGIN trtllm-mapping (generated by trtserver.engine.trtllm.mapping.render_markdown) -->"
DOC_END = "<!-- END trtllm-mapping -->"


def splice_doc(text: str) -> str:
    """``text`` with the generated table replaced between the markers."""
    start = text.index(DOC_BEGIN) + len(DOC_BEGIN)
    end = text.index(DOC_END)
    return text[:start] + "\n" + render_markdown() + text[end:]

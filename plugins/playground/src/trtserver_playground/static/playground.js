// The playground page: plain JavaScript, no build step, nothing loaded from anywhere but this server.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "trtserver-playground-api-key";
  const KEY_MESSAGE = "This server needs an API key (401 Unauthorized). Type it in the API key field at the top left, then send again.";
  const METRICS_EVERY_MS = 1000;

  let modelId = null;
  let history = [];        // chat turns already answered: [{role, content}]
  let lastAnswer = null;   // the chat answer on display, joined to history on the next send
  let controller = null;   // AbortController of the request in flight
  let choices = [];

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // --- small helpers -------------------------------------------------------------------------

  function setStatus(text, kind = "") {
    const el = $("status");
    el.textContent = text;
    el.className = kind;
  }

  function apiKey() {
    return $("api-key").value.trim();
  }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorOf(response, path) {
    if (response.status === 404 && path === "/v1/chat/completions") {
      return new HttpError(404, "This server has no /v1/chat/completions: use Completion mode.");
    }
    if (response.status === 401) {
      $("api-key").classList.add("needs-key");
      return new HttpError(401, KEY_MESSAGE);
    }
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) {
        message = `${response.status}: ${body.error.message}` + (body.error.param ? ` (param: ${body.error.param})` : "");
      }
    } catch (_) { /* not JSON: the status line says enough */ }
    return new HttpError(response.status, message);
  }

  function mode() {
    return document.querySelector('input[name="mode"]:checked').value;
  }

  function numberField(id) {
    const text = $(id).value.trim();
    if (text === "") return undefined;
    const value = Number(text);
    if (Number.isNaN(value)) throw new Error(`${id} is not a number`);
    return value;
  }

  function unescape(text) {
    return text.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
  }

  function seconds(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  // --- the model and the live panel ------------------------------------------------------------

  async function loadModel() {
    const response = await fetch("/v1/models", { headers: headers(false) });
    if (!response.ok) throw await errorOf(response);
    const list = await response.json();
    const card = list.data[0];
    modelId = card.id;
    $("model-id").textContent = card.id;
    $("model-context").textContent = card.max_model_len ? `${card.max_model_len} tokens` : "unknown";
    const fingerprint = $("model-fingerprint");
    if (card.system_fingerprint) fingerprint.textContent = card.system_fingerprint;
    else if (fingerprint.textContent === "…") fingerprint.textContent = "with the first answer";
    $("api-key").classList.remove("needs-key");
  }

  function parseMetrics(text) {
    const values = {};
    for (const line of text.split("\n")) {
      const match = /^([A-Za-z_:][\w:]*)\s+(\S+)/.exec(line);
      if (match) values[match[1]] = Number(match[2]);
    }
    return values;
  }

  async function refreshMetrics() {
    try {
      const response = await fetch("/metrics", { cache: "no-store" });
      if (!response.ok) return;
      const m = parseMetrics(await response.text());
      const show = (id, value) => { $(id).textContent = value === undefined ? "–" : String(value); };
      show("metric-queue", m.trtserver_queue_depth);
      show("metric-running", m.trtserver_running_sequences);
      const used = m.trtserver_kv_slots_used, total = m.trtserver_kv_slots_total;
      show("metric-kv", used === undefined ? undefined : `${used}/${total}`);
    } catch (_) { /* the server is restarting: the next poll tells */ }
  }

  async function pollMetrics() {
    await refreshMetrics();
    setTimeout(pollMetrics, METRICS_EVERY_MS);
  }

  // --- the request -----------------------------------------------------------------------------

  function addGuide(body, chat) {
    const kind = $("guide-kind").value;
    if (!kind) return;
    const spec = $("guide-spec").value;
    if (kind === "json") {
      if (spec.trim() === "") {
        body.response_format = { type: "json_object" };
      } else {
        let schema;
        try {
          schema = JSON.parse(spec);
        } catch (err) {
          throw new Error("The JSON schema is not valid JSON: " + err.message);
        }
        if (chat) body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
        else body.guided_json = schema;
      }
    } else if (kind === "regex") {
      body.guided_regex = spec;
    } else if (kind === "choice") {
      body.guided_choice = spec.split("\n").filter((s) => s.trim() !== "");
    } else if (kind === "grammar") {
      body.guided_grammar = spec;
    }
    const backend = $("guide-backend").value;
    if (backend) body.guided_decoding_backend = backend;
  }

  function buildBody(chat, prompt) {
    const body = { stream: true, stream_options: { include_usage: true } };
    if (modelId) body.model = modelId;
    for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "n"]) {
      const value = numberField(id);
      if (value !== undefined) body[id] = value;
    }
    const stop = $("stop").value.split("\n").filter((s) => s !== "").map(unescape);
    if (stop.length) body.stop = stop;
    const logprobs = $("logprobs").checked;
    const alternatives = numberField("top_logprobs") || 0;
    if (chat) {
      const messages = [];
      const system = $("system").value.trim();
      if (system) messages.push({ role: "system", content: system });
      body.messages = messages.concat(history, [{ role: "user", content: prompt }]);
      if (logprobs) {
        body.logprobs = true;
        body.top_logprobs = alternatives;
      }
    } else {
      body.prompt = prompt;
      if (logprobs) body.logprobs = alternatives;
    }
    addGuide(body, chat);
    return body;
  }

  // Server-sent events from a fetch body: one parsed JSON object per `data:` event, up to [DONE].
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let match;
      while ((match = /\r?\n\r?\n/.exec(buffer)) !== null) {
        const block = buffer.slice(0, match.index);
        buffer = buffer.slice(match.index + match[0].length);
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data === "") continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  // One token list per chunk choice, whichever API sent it: [{token, logprob, alternatives: [[token, logprob]]}]
  function tokensOf(choice) {
    const lp = choice.logprobs;
    if (!lp) return null;
    if (Array.isArray(lp.content)) {
      return lp.content.map((t) => ({
        token: t.token,
        logprob: t.logprob,
        alternatives: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
      }));
    }
    if (Array.isArray(lp.tokens)) {
      return lp.tokens.map((token, i) => ({
        token,
        logprob: lp.token_logprobs ? lp.token_logprobs[i] : null,
        alternatives: Object.entries((lp.top_logprobs && lp.top_logprobs[i]) || {}),
      }));
    }
    return null;
  }

  function textOf(choice) {
    if (typeof choice.text === "string") return choice.text;
    const delta = choice.delta;
    return delta && typeof delta.content === "string" ? delta.content : "";
  }

  // --- the answer on display -------------------------------------------------------------------

  class ChoiceView {
    constructor(index, count) {
      this.text = "";
      this.tokens = 0;
      this.finish = null;
      this.el = document.createElement("div");
      this.el.className = "choice";
      this.el.dataset.index = String(index);
      if (count > 1) {
        const label = document.createElement("div");
        label.className = "choice-label";
        label.textContent = `choice ${index}`;
        this.el.append(label);
      }
      this.textEl = document.createElement("div");
      this.textEl.className = "text";
      this.tokensEl = document.createElement("div");
      this.tokensEl.className = "tokens";
      this.checkEl = document.createElement("div");
      this.checkEl.className = "check";
      this.el.append(this.textEl, this.tokensEl, this.checkEl);
      $("output").append(this.el);
    }

    add(text, tokens) {
      if (text) {
        this.text += text;
        this.textEl.textContent = this.text;
      }
      if (tokens) {
        for (const t of tokens) this.tokensEl.append(tokenSpan(t));
        this.tokens += tokens.length;
      } else if (text) {
        this.tokens += 1;
      }
    }

    checkJson() {
      try {
        JSON.parse(this.text);
        this.checkEl.textContent = "valid JSON";
        this.checkEl.className = "check ok";
      } catch (err) {
        this.checkEl.textContent = "not valid JSON: " + err.message;
        this.checkEl.className = "check bad";
      }
    }
  }

  function tokenSpan(t) {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = t.token;
    if (t.token.includes("\n")) span.classList.add("newline");
    if (typeof t.logprob === "number") {
      const p = Math.exp(t.logprob);
      span.style.backgroundColor = `hsl(${Math.round(120 * p)}, 75%, 78%)`;
      span.dataset.p = p.toFixed(4);
    }
    span.dataset.alternatives = JSON.stringify(t.alternatives);
    return span;
  }

  function showTooltip(event) {
    const span = event.target.closest(".tok");
    const tip = $("tooltip");
    if (!span) {
      tip.hidden = true;
      return;
    }
    const rows = JSON.parse(span.dataset.alternatives || "[]").sort((a, b) => b[1] - a[1]);
    tip.replaceChildren();
    const head = document.createElement("div");
    head.className = "tip-head";
    head.textContent = `${JSON.stringify(span.textContent)}  p=${span.dataset.p ?? "?"}`;
    tip.append(head);
    for (const [token, logprob] of rows) {
      const row = document.createElement("div");
      row.textContent = `${JSON.stringify(token)}  ${Math.exp(logprob).toFixed(4)}`;
      tip.append(row);
    }
    if (rows.length === 0) {
      const row = document.createElement("div");
      row.textContent = "no alternatives asked for";
      tip.append(row);
    }
    const box = span.getBoundingClientRect();
    tip.style.left = `${box.left + window.scrollX}px`;
    tip.style.top = `${box.bottom + window.scrollY + 4}px`;
    tip.hidden = false;
  }

  function renderTranscript() {
    const el = $("transcript");
    el.replaceChildren();
    for (const message of history) {
      const bubble = document.createElement("div");
      bubble.className = `message ${message.role}`;
      bubble.textContent = message.content;
      el.append(bubble);
    }
  }

  function showStats(s, done) {
    $("stat-ttft").textContent = s.first === null ? "–" : seconds(s.first - s.start);
    const tokens = s.usage ? s.usage.completion_tokens : choices.reduce((sum, c) => sum + c.tokens, 0);
    const now = done ? s.end : performance.now();
    // decode speed: the tokens after each choice's first, over the time since the first arrived
    const after = tokens - choices.filter((c) => c.tokens > 0).length;
    if (s.first !== null && after > 0 && now > s.first) {
      $("stat-tps").textContent = (after / ((now - s.first) / 1000)).toFixed(1);
    }
    $("stat-completion").textContent = String(tokens);
    if (s.usage) $("stat-prompt").textContent = String(s.usage.prompt_tokens);
    const finishes = choices.map((c) => c.finish).filter(Boolean);
    if (finishes.length) $("stat-finish").textContent = finishes.join(", ");
  }

  // --- send and stop ---------------------------------------------------------------------------

  async function send(event) {
    event.preventDefault();
    if (controller) return;
    const chat = mode() === "chat";
    const prompt = $("prompt").value;
    if (chat && prompt.trim() === "") {
      setStatus("Type a message first.");
      return;
    }
    controller = new AbortController();
    $("send").disabled = true;
    $("stop-button").disabled = false;
    setStatus("Waiting for the first token…", "busy");
    for (const id of ["stat-ttft", "stat-tps", "stat-prompt", "stat-completion", "stat-finish"]) $(id).textContent = "–";
    $("output").replaceChildren();
    choices = [];
    const s = { start: performance.now(), first: null, end: null, usage: null };
    let ticker = null;
    let asked = false;  // this turn's user message is in the history
    try {
      if (modelId === null) await loadModel();
      if (chat && lastAnswer !== null) history.push(lastAnswer);
      lastAnswer = null;
      const body = buildBody(chat, prompt);
      if (chat) {
        history.push({ role: "user", content: prompt });
        asked = true;
        renderTranscript();
        $("prompt").value = "";
      }
      const count = body.n || 1;
      for (let i = 0; i < count; i++) choices.push(new ChoiceView(i, count));
      const path = chat ? "/v1/chat/completions" : "/v1/completions";
      const response = await fetch(path, {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw await errorOf(response, path);
      ticker = setInterval(() => showStats(s, false), 250);
      for await (const chunk of events(response)) {
        if (chunk.error) throw new HttpError(chunk.error.code || 500, chunk.error.message);
        if (chunk.system_fingerprint) $("model-fingerprint").textContent = chunk.system_fingerprint;
        if (chunk.usage) s.usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const view = choices[choice.index] || choices[0];
          const text = textOf(choice);
          const tokens = tokensOf(choice);
          if ((text || (tokens && tokens.length)) && s.first === null) {
            s.first = performance.now();
            setStatus("Streaming…", "busy");
          }
          view.add(text, tokens);
          if (choice.finish_reason) view.finish = choice.finish_reason;
        }
        if (s.first !== null && s.shown === undefined) {
          s.shown = true;  // the first token's stats at once, then the ticker's
          showStats(s, false);
        }
      }
      s.end = performance.now();
      showStats(s, true);
      setStatus(`Done in ${seconds(s.end - s.start)}.`, "ok");
      if ($("guide-kind").value === "json") for (const view of choices) view.checkJson();
      if (chat && choices.length) lastAnswer = { role: "assistant", content: choices[0].text };
    } catch (err) {
      s.end = performance.now();
      if (err.name === "AbortError") {
        showStats(s, true);
        setStatus("Stopped. The server has been told and frees the slot.", "stopped");
        if (chat && choices.length) lastAnswer = { role: "assistant", content: choices[0].text };
      } else {
        setStatus(err.message, "error");
        if (!choices.some((c) => c.text)) $("output").replaceChildren();
        // a turn that got no answer is not kept
        if (asked && !choices.some((c) => c.text)) {
          $("prompt").value = history.pop().content;
          renderTranscript();
        }
      }
    } finally {
      if (ticker !== null) clearInterval(ticker);
      controller = null;
      $("send").disabled = false;
      $("stop-button").disabled = true;
      // the server has let go of the request by now (or within a moment when stopped)
      setTimeout(refreshMetrics, 100);
    }
  }

  function stop() {
    if (controller) controller.abort();
  }

  function clear() {
    stop();
    history = [];
    lastAnswer = null;
    choices = [];
    renderTranscript();
    $("output").replaceChildren();
    setStatus("");
  }

  // --- wiring ----------------------------------------------------------------------------------

  function showMode() {
    document.body.dataset.mode = mode();
    $("prompt").placeholder = mode() === "chat"
      ? "Type a message, Ctrl+Enter to send" : "Type the text to continue, Ctrl+Enter to send";
  }

  function showView() {
    document.body.dataset.view = document.querySelector('input[name="view"]:checked').value;
  }

  function showTab(name) {
    for (const button of document.querySelectorAll(".tabs button")) {
      button.classList.toggle("active", button.dataset.tab === name);
    }
    for (const panel of document.querySelectorAll(".tab-panel")) panel.hidden = panel.id !== `tab-${name}`;
  }

  function start() {
    const key = $("api-key");
    key.value = sessionStorage.getItem(KEY_STORE) || "";
    key.addEventListener("input", () => {
      if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
      else sessionStorage.removeItem(KEY_STORE);
    });
    key.addEventListener("change", () => {
      if (modelId === null) loadModel().then(() => setStatus(""), (err) => setStatus(err.message, "error"));
    });
    $("key-form").addEventListener("submit", (e) => e.preventDefault());
    $("composer").addEventListener("submit", send);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("composer").requestSubmit();
    });
    $("stop-button").addEventListener("click", stop);
    $("clear").addEventListener("click", clear);
    for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", showMode);
    for (const radio of document.querySelectorAll('input[name="view"]')) radio.addEventListener("change", showView);
    for (const button of document.querySelectorAll(".tabs button")) {
      button.addEventListener("click", () => showTab(button.dataset.tab));
    }
    $("output").addEventListener("mouseover", showTooltip);
    $("output").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    showMode();
    showView();
    loadModel().catch((err) => setStatus(err.message, "error"));
    pollMetrics();
  }

  start();
})();

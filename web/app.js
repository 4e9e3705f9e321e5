// docent's web page: asks questions (streamed over SSE), shows citations and sources,
// uploads, lists and deletes documents. Plain JavaScript, no dependencies. Text from the
// server is only ever put into the page as text nodes (never parsed as HTML).

const KEY_NAME = 'docent.apiKey';
const SETTINGS_NAME = 'docent.settings';
const JOB_POLL_MS = 400;
const COLLECTION_RULE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

const $ = (id) => document.getElementById(id);

/** An element with attributes and children (strings become text nodes). */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svgIcon(path) {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('viewBox', '0 0 24 24');
  svg.setAttribute('width', '18');
  svg.setAttribute('height', '18');
  svg.setAttribute('aria-hidden', 'true');
  const p = document.createElementNS(ns, 'path');
  p.setAttribute('d', path);
  svg.append(p);
  return svg;
}
const ICON_TRASH = 'M4 7h16M10 11v6M14 11v6M6 7l1 12a2 2 0 0 0 2 2h6a2 2 0 0 0 2-2l1-12M9 7V4h6v3';
const ICON_CLOSE = 'M6 6l12 12M18 6L6 18';

function basename(path) {
  const parts = String(path || '').split(/[\\/]/);
  return parts[parts.length - 1] || String(path || '');
}

function plural(n, one, many) {
  return `${n.toLocaleString()} ${n === 1 ? one : many}`;
}

/** Joins a paragraph's wrapped lines (the source's line breaks inside a sentence are
 * wrapping, not meaning); blank lines between paragraphs stay. */
function unwrap(text) {
  return text.split(/\n[ \t]*\n/).map((p) => p.trim().split(/[ \t]*\n[ \t]*/).join(' ')).join('\n\n');
}

function formatScore(s) {
  if (typeof s !== 'number' || !Number.isFinite(s)) return '–';
  return Math.abs(s) >= 10 ? s.toFixed(1) : s.toFixed(3);
}

function formatMs(ms) {
  if (typeof ms !== 'number') return '';
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

// ---------------------------------------------------------------------------------------
// API keys and errors

const keys = {
  get() {
    return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || '';
  },
  set(key, remember) {
    this.forget();
    (remember ? localStorage : sessionStorage).setItem(KEY_NAME, key);
    showKeyState();
  },
  forget() {
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
    showKeyState();
  },
};

function showKeyState() {
  $('forget-key').hidden = !keys.get();
}

/** An error answered by the server, in its one JSON shape. */
class ApiError extends Error {
  constructor(status, code, message, details, retryAfter) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
    this.details = details;
    this.retryAfter = retryAfter;
  }
}

function errorFrom(status, bodyText, retryAfter, statusText) {
  let e = null;
  try {
    e = JSON.parse(bodyText).error;
  } catch {
    e = null;
  }
  return new ApiError(
    status,
    (e && e.code) || `http_${status}`,
    (e && e.message) || statusText || `the server answered ${status}`,
    (e && e.details) || null,
    retryAfter ? Number(retryAfter) : null,
  );
}

async function errorOf(res) {
  const text = await res.text().catch(() => '');
  return errorFrom(res.status, text, res.headers.get('retry-after'), res.statusText);
}

/** What to tell the user about a failure. */
function describe(err) {
  if (err && err.name === 'AbortError') return { text: 'Stopped.' };
  if (!(err instanceof ApiError)) {
    return { text: `Could not reach the server (${err && err.message ? err.message : err}). Is docent running?` };
  }
  let text = err.message;
  if (err.status === 429 || err.status === 503) {
    text += err.retryAfter
      ? ` Try again in ${plural(err.retryAfter, 'second', 'seconds')}.`
      : ' Try again in a moment.';
  }
  return { text, code: `${err.status} ${err.code}` };
}

// One prompt for a key at a time, however many requests were refused.
let keyPrompt = null;

/** Asks for an API key; true once one is entered, false when the user cancels. */
function askForKey(err) {
  if (keyPrompt) return keyPrompt;
  const dialog = $('key-dialog');
  const hadKey = Boolean(keys.get());
  $('key-error').textContent = hadKey ? `The key was refused: ${err.message}` : '';
  $('key-input').value = '';
  $('key-remember').checked = Boolean(localStorage.getItem(KEY_NAME));
  keyPrompt = new Promise((resolve) => {
    const done = (ok) => {
      $('key-form').removeEventListener('submit', onSubmit);
      $('key-cancel').removeEventListener('click', onCancel);
      dialog.removeEventListener('cancel', onCancel);
      dialog.close();
      keyPrompt = null;
      resolve(ok);
    };
    const onSubmit = (ev) => {
      ev.preventDefault();
      const key = $('key-input').value.trim();
      if (!key) {
        $('key-error').textContent = 'Enter a key.';
        $('key-input').focus();
        return;
      }
      keys.set(key, $('key-remember').checked);
      done(true);
    };
    const onCancel = (ev) => {
      ev.preventDefault();
      done(false);
    };
    $('key-form').addEventListener('submit', onSubmit);
    $('key-cancel').addEventListener('click', onCancel);
    dialog.addEventListener('cancel', onCancel);
    dialog.showModal();
    $('key-input').focus();
  });
  return keyPrompt;
}

function withKey(headers = {}) {
  const key = keys.get();
  return key ? { ...headers, authorization: `Bearer ${key}` } : headers;
}

/** fetch with the API key; asks for a key and retries on 401; throws ApiError otherwise. */
async function api(path, init = {}) {
  for (;;) {
    const res = await fetch(path, { ...init, headers: withKey(init.headers) });
    if (res.status === 401) {
      const err = await errorOf(res);
      if (await askForKey(err)) continue;
      throw err;
    }
    if (!res.ok) throw await errorOf(res);
    return res;
  }
}

async function apiJson(path, init) {
  return (await api(path, init)).json();
}

// ---------------------------------------------------------------------------------------
// notices

function notify(text, { error = false, code = null, timeout = error ? 0 : 5000 } = {}) {
  const close = h('button', { type: 'button', class: 'icon', 'aria-label': 'Dismiss' }, svgIcon(ICON_CLOSE));
  const body = h('div', { class: 'body' }, text, code ? h('span', { class: 'visually-hidden' }, ` (${code})`) : null);
  const el = h('div', { class: `notice${error ? ' error' : ''}`, role: error ? 'alert' : 'status' }, body, close);
  close.addEventListener('click', () => el.remove());
  $('notices').append(el);
  if (timeout) setTimeout(() => el.remove(), timeout);
  return el;
}

function notifyError(prefix, err) {
  const d = describe(err);
  notify(`${prefix}: ${d.text}`, { error: true, code: d.code });
}

// ---------------------------------------------------------------------------------------
// settings

const settings = {
  value: { collection: '', top_k: '', mode: '', temperature: '' },
  load() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_NAME) || '{}');
      for (const k of Object.keys(this.value)) {
        if (typeof saved[k] === 'string') this.value[k] = saved[k];
      }
    } catch {
      /* a broken entry is replaced at the next save */
    }
  },
  save() {
    localStorage.setItem(SETTINGS_NAME, JSON.stringify(this.value));
  },
};

function showSettingsSummary() {
  const s = settings.value;
  const parts = [
    s.mode ? `${s.mode === 'sparse' ? 'keyword' : s.mode} search` : 'default search',
    s.top_k ? `${s.top_k} passages` : null,
    s.temperature !== '' ? `temperature ${s.temperature}` : null,
    s.collection ? `collection “${s.collection}”` : 'all collections',
  ].filter(Boolean);
  $('settings-summary').textContent = parts.join(' · ');
  // the accessible name contains the visible text (speech input users say what they see)
  $('settings-summary').setAttribute('aria-label', `Search settings: ${parts.join(' · ')}`);
  $('drop-collection').textContent = s.collection ? `Uploads go to the collection “${s.collection}”.` : '';
}

function openSettings() {
  const s = settings.value;
  $('set-collection').value = s.collection;
  $('set-top-k').value = s.top_k;
  $('set-temperature').value = s.temperature;
  for (const r of document.querySelectorAll('#settings-form input[name="mode"]')) r.checked = r.value === s.mode;
  $('settings-error').textContent = '';
  $('settings').showModal();
  $('set-collection').focus();
}

function readSettingsForm() {
  const collection = $('set-collection').value.trim();
  const topK = $('set-top-k').value.trim();
  const temperature = $('set-temperature').value.trim();
  const mode = document.querySelector('#settings-form input[name="mode"]:checked');
  if (collection && !COLLECTION_RULE.test(collection)) {
    return { error: 'A collection name is 1 to 64 letters, digits, dots, dashes or underscores, starting with a letter or digit.', field: 'set-collection' };
  }
  if (topK && !(/^\d+$/.test(topK) && Number(topK) >= 1)) {
    return { error: 'Passages must be a whole number, 1 or more.', field: 'set-top-k' };
  }
  if (temperature && !(Number(temperature) >= 0 && Number(temperature) <= 2)) {
    return { error: 'Temperature must be between 0 and 2.', field: 'set-temperature' };
  }
  return { value: { collection, top_k: topK, mode: mode ? mode.value : '', temperature } };
}

function wireSettings() {
  $('open-settings').addEventListener('click', openSettings);
  $('settings-summary').addEventListener('click', openSettings);
  $('settings-cancel').addEventListener('click', () => $('settings').close());
  $('settings-reset').addEventListener('click', () => {
    $('set-collection').value = '';
    $('set-top-k').value = '';
    $('set-temperature').value = '';
    for (const r of document.querySelectorAll('#settings-form input[name="mode"]')) r.checked = r.value === '';
  });
  $('settings-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const read = readSettingsForm();
    if (read.error) {
      $('settings-error').textContent = read.error;
      $(read.field).focus();
      return;
    }
    const collectionChanged = read.value.collection !== settings.value.collection;
    settings.value = read.value;
    settings.save();
    showSettingsSummary();
    $('settings').close();
    notify('Settings saved.');
    if (collectionChanged) loadDocuments();
  });
}

// ---------------------------------------------------------------------------------------
// Server-Sent Events over fetch (EventSource cannot POST)

function parseEvent(block) {
  let event = 'message';
  const data = [];
  for (const line of block.split(/\r\n|\r|\n/)) {
    if (!line || line.startsWith(':')) continue;
    const i = line.indexOf(':');
    const field = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? '' : line.slice(i + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  return data.length ? { event, data: data.join('\n') } : null;
}

async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let m;
    while ((m = /\r\n\r\n|\n\n|\r\r/.exec(buffer))) {
      const ev = parseEvent(buffer.slice(0, m.index));
      buffer = buffer.slice(m.index + m[0].length);
      if (ev) yield ev;
    }
  }
  const last = parseEvent(buffer);
  if (last) yield last;
}

// ---------------------------------------------------------------------------------------
// asking and the answer

const answer = {
  controller: null,
  citations: new Map(),
  hits: [],
  pending: '',
  deltas: 0,
  started: 0,
};

const MARKER = /\[(\d{1,3})\]/g;

function setAnswerState(state) {
  $('answer-section').dataset.state = state;
  $('answer').setAttribute('aria-busy', state === 'streaming' ? 'true' : 'false');
  const streaming = state === 'streaming';
  $('ask-button').disabled = streaming;
  $('stop-button').hidden = !streaming;
}

function citeLabel(n) {
  const c = answer.citations.get(n);
  return c ? `Source ${n}: ${c.title || basename(c.source)}` : `Source ${n}`;
}

function markerButton(n) {
  const b = h('button', {
    type: 'button',
    class: answer.citations.has(n) ? 'cite' : 'cite pending',
    dataset: { n: String(n) },
    'aria-haspopup': 'dialog',
    'aria-expanded': 'false',
    'aria-controls': 'passage',
    'aria-label': citeLabel(n),
  }, String(n));
  b.addEventListener('click', () => openPassage(n, b));
  return b;
}

/** Adds streamed text; `[n]` markers become buttons. A marker cut at the end of a delta
 * is held back until the next one (the server does not split them, but be safe). */
function appendAnswer(text, final = false) {
  const el = $('answer');
  let s = answer.pending + text;
  answer.pending = '';
  if (!final) {
    const open = s.lastIndexOf('[');
    if (open >= 0 && s.indexOf(']', open) < 0 && s.length - open <= 4) {
      answer.pending = s.slice(open);
      s = s.slice(0, open);
    }
  }
  let last = 0;
  for (const m of s.matchAll(MARKER)) {
    if (m.index > last) appendFormatted(el, s.slice(last, m.index));
    el.append(markerButton(Number(m[1])));
    last = m.index + m[0].length;
  }
  if (last < s.length) appendFormatted(el, s.slice(last));
}

const INLINE = /\*\*([^*\n]+)\*\*|`([^`\n]+)`/g;

/** Text with `**bold**` and `` `code` `` shown as such; everything else as plain text. */
function appendFormatted(el, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) el.append(document.createTextNode(text.slice(last, m.index)));
    el.append(m[1] !== undefined ? h('strong', {}, m[1]) : h('code', {}, m[2]));
    last = m.index + m[0].length;
  }
  if (last < text.length) el.append(document.createTextNode(text.slice(last)));
}

function refreshMarkers() {
  for (const b of $('answer').querySelectorAll('button.cite')) {
    const n = Number(b.dataset.n);
    b.classList.toggle('pending', !answer.citations.has(n));
    b.setAttribute('aria-label', citeLabel(n));
  }
}

/** At the end: a marker that cites nothing is shown as the text it was. */
function settleMarkers() {
  for (const b of $('answer').querySelectorAll('button.cite')) {
    const n = Number(b.dataset.n);
    if (!answer.citations.has(n)) b.replaceWith(document.createTextNode(`[${n}]`));
  }
  $('answer').normalize();
}

function hitFor(c) {
  return answer.hits.find((x) => x.document_id === c.document_id && x.chunk_index === c.chunk_index) || null;
}

function renderSources() {
  const list = $('sources');
  list.replaceChildren();
  const cited = [...answer.citations.values()].sort((a, b) => a.n - b.n);
  for (const c of cited) {
    const where = [basename(c.source), c.page ? `page ${c.page}` : null, `score ${formatScore(c.score)}`].filter(Boolean).join(' · ');
    const open = h('button', { type: 'button', class: 'source-open', 'aria-haspopup': 'dialog', 'aria-controls': 'passage', 'aria-expanded': 'false', dataset: { n: String(c.n) } },
      h('span', { class: 'title' }, c.title || basename(c.source)),
      h('span', { class: 'where' }, where),
      c.quote ? h('span', { class: 'excerpt' }, `“${c.quote}”`) : null,
    );
    open.addEventListener('click', () => openPassage(c.n, open));
    list.append(h('li', {}, h('span', { class: 'n', 'aria-hidden': 'true' }, String(c.n)), open));
  }
  $('sources-section').hidden = cited.length === 0;
}

function renderRetrieved(data) {
  const list = $('retrieved');
  list.replaceChildren();
  for (const hit of data.hits || []) {
    const where = [hit.title || basename(hit.source), hit.page ? `page ${hit.page}` : null, `score ${formatScore(hit.score)}`].filter(Boolean).join(' · ');
    list.append(h('li', {}, h('span', { class: 'where' }, where), h('p', { class: 'text' }, hit.text || '')));
  }
  const n = (data.hits || []).length;
  $('retrieved-summary').textContent = `Retrieved ${plural(n, 'passage', 'passages')} (${data.mode || 'search'}, ${formatMs(data.retrieval_ms)})`;
  $('retrieved-section').hidden = n === 0;
}

function badge(text, kind = '') {
  return h('span', { class: `badge ${kind}` }, text);
}

function finishAnswer(done) {
  appendAnswer('', true);
  if ($('answer').textContent.trim() === '' && done.answer) appendAnswer(done.answer, true);
  answer.citations = new Map((done.citations || []).map((c) => [c.n, c]));
  settleMarkers();
  refreshMarkers();
  renderSources();
  const badges = [];
  if (done.mode === 'extractive') badges.push(badge('quoted', 'accent'));
  if (done.mode === 'refusal' || done.answerable === false) badges.push(badge('not found', 'warn'));
  if (done.mode === 'withheld' || (done.safety && done.safety.blocked)) badges.push(badge('withheld', 'warn'));
  if (done.cached) badges.push(badge('cached'));
  if (done.safety && done.safety.redactions) badges.push(badge(`${done.safety.redactions} redacted`, 'warn'));
  $('answer-badges').replaceChildren(...badges);
  const u = done.usage || {};
  const facts = [
    formatMs(u.total_ms ?? performance.now() - answer.started),
    typeof u.completion_tokens === 'number' ? plural(u.completion_tokens, 'token', 'tokens') : null,
    typeof u.tokens_per_second === 'number' && u.tokens_per_second > 0 ? `${u.tokens_per_second.toFixed(1)} tokens/s` : null,
    u.context_chunks_dropped ? `${plural(u.context_chunks_dropped, 'passage', 'passages')} left out (context full)` : null,
  ].filter(Boolean);
  $('answer-meta').textContent = facts.join(' · ');
  $('answer-meta').hidden = facts.length === 0;
  const cites = answer.citations.size;
  $('answer-status').textContent = done.answerable === false
    ? 'No passage in your documents answers this closely enough.'
    : cites ? `Answered with ${plural(cites, 'source', 'sources')}. Select a number to see the passage.` : 'Answered without citing a source.';
}

function showAnswerError(err) {
  const d = describe(err);
  const box = $('answer-error');
  box.replaceChildren(h('strong', {}, err && err.name === 'AbortError' ? 'Stopped. ' : 'The question could not be answered. '), d.text,
    d.code ? h('span', { class: 'code' }, d.code) : null);
  box.hidden = false;
}

async function ask(question) {
  if (answer.controller) answer.controller.abort();
  const controller = new AbortController();
  answer.controller = controller;
  Object.assign(answer, { citations: new Map(), hits: [], pending: '', deltas: 0, started: performance.now() });
  closePassage();
  $('answer').replaceChildren();
  $('answer').dataset.deltas = '0';
  $('answer-error').hidden = true;
  $('answer-meta').hidden = true;
  $('answer-badges').replaceChildren();
  $('sources-section').hidden = true;
  $('retrieved-section').hidden = true;
  $('answer-status').textContent = 'Searching your documents…';
  setAnswerState('streaming');

  const s = settings.value;
  const retrieval = {};
  if (s.top_k) retrieval.top_k = Number(s.top_k);
  if (s.mode) retrieval.mode = s.mode;
  if (s.collection) retrieval.filter = { collection: s.collection };
  const generation = {};
  if (s.temperature !== '') generation.temperature = Number(s.temperature);
  const body = { question, stream: true, retrieval, generation };

  let finished = false;
  try {
    const res = await api('/v1/query', {
      method: 'POST',
      headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    for await (const ev of events(res.body)) {
      let data;
      try {
        data = JSON.parse(ev.data);
      } catch {
        continue;
      }
      if (ev.event === 'retrieval') {
        answer.hits = data.hits || [];
        renderRetrieved(data);
        $('answer-status').textContent = `Found ${plural(answer.hits.length, 'passage', 'passages')}. Writing the answer…`;
      } else if (ev.event === 'delta') {
        answer.deltas += 1;
        $('answer').dataset.deltas = String(answer.deltas);
        appendAnswer(data.text || '');
      } else if (ev.event === 'citation') {
        answer.citations.set(data.n, data);
        refreshMarkers();
        renderSources();
      } else if (ev.event === 'done') {
        finished = true;
        finishAnswer(data);
      } else if (ev.event === 'error') {
        const e = data.error || {};
        throw new ApiError(200, e.code || 'stream_error', e.message || 'generation failed', e.details || null, null);
      }
    }
    if (!finished) throw new Error('the answer stopped before it was complete (the connection closed)');
  } catch (err) {
    if (answer.controller !== controller) return; // a newer question took over
    appendAnswer('', true);
    settleMarkers();
    renderSources();
    showAnswerError(err);
    $('answer-status').textContent = err.name === 'AbortError' ? 'Stopped.' : 'The answer failed.';
  } finally {
    if (answer.controller === controller) {
      answer.controller = null;
      setAnswerState(finished ? 'done' : 'failed');
    }
  }
}

function wireAsk() {
  const form = $('ask-form');
  const q = $('question');
  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const question = q.value.trim();
    if (!question) {
      q.focus();
      $('answer-status').textContent = 'Type a question first.';
      return;
    }
    ask(question);
  });
  q.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      form.requestSubmit();
    }
  });
  $('stop-button').addEventListener('click', () => {
    if (answer.controller) answer.controller.abort();
    q.focus();
  });
  document.addEventListener('keydown', (ev) => {
    const typing = ev.target.closest && ev.target.closest('input, textarea, select, [contenteditable]');
    if (ev.key === '/' && !typing && !document.querySelector('dialog[open]')) {
      ev.preventDefault();
      q.focus();
    }
  });
}

// ---------------------------------------------------------------------------------------
// the passage panel

let passageOpener = null;
let lastOpener = null;

function fact(term, value, mono = false) {
  return [h('dt', {}, term), h('dd', { class: mono ? 'mono' : null }, value)];
}

function placePassage(anchor) {
  const panel = $('passage');
  if (window.matchMedia('(max-width: 640px)').matches) {
    panel.style.left = '';
    panel.style.top = '';
    return;
  }
  const r = anchor.getBoundingClientRect();
  const w = panel.offsetWidth;
  const hgt = panel.offsetHeight;
  const margin = 12;
  let left = Math.min(Math.max(margin, r.left + r.width / 2 - w / 2), window.innerWidth - w - margin);
  let top = r.bottom + 8;
  if (top + hgt > window.innerHeight - margin && r.top - 8 - hgt > margin) top = r.top - 8 - hgt;
  top = Math.max(margin, Math.min(top, window.innerHeight - hgt - margin));
  left = Math.max(margin, left);
  panel.style.left = `${left}px`;
  panel.style.top = `${top}px`;
}

function openPassage(n, opener) {
  const c = answer.citations.get(n);
  const panel = $('passage');
  if (!c) {
    notify(`Source ${n} is still arriving; try again in a moment.`);
    return;
  }
  const same = passageOpener === opener;
  closePassage();
  if (same) return;
  $('passage-title').textContent = `[${c.n}] ${c.title || basename(c.source)}`;
  $('passage-quote').textContent = c.quote ? unwrap(c.quote) : '(no quote)';
  const facts = [
    ...fact('Document', c.title || basename(c.source)),
    ...fact('Source', c.source, true),
    ...(c.page ? fact('Page', String(c.page)) : []),
    ...fact('Score', formatScore(c.score)),
    ...fact('Passage', `chunk ${c.chunk_index}, bytes ${c.span ? `${c.span.start}–${c.span.end}` : '?'}`),
    ...(c.inferred ? fact('Marker', 'added by docent (the model did not cite)') : []),
  ];
  $('passage-facts').replaceChildren(...facts);
  const hit = hitFor(c);
  $('passage-context').hidden = !hit;
  $('passage-context').open = false;
  $('passage-text').textContent = hit ? hit.text : '';
  passageOpener = opener;
  lastOpener = opener;
  opener.setAttribute('aria-expanded', 'true');
  // with its opener as the source, a click on the opener does not light-dismiss it first
  panel.showPopover({ source: opener });
  placePassage(opener);
  panel.focus();
}

/** Closes the panel without moving the focus (the opener keeps or gets it elsewhere). */
function closePassage() {
  const panel = $('passage');
  const opener = passageOpener;
  passageOpener = null;
  if (opener) opener.setAttribute('aria-expanded', 'false');
  if (panel.matches(':popover-open')) panel.hidePopover();
}

function wirePassage() {
  const panel = $('passage');
  $('passage-close').addEventListener('click', closePassage);
  // Escape, a click elsewhere or the close button: the focus goes back to the marker
  panel.addEventListener('beforetoggle', (ev) => {
    if (ev.newState !== 'closed') return;
    const focusInside = panel.contains(document.activeElement);
    const opener = passageOpener || lastOpener;
    passageOpener = null;
    if (opener) opener.setAttribute('aria-expanded', 'false');
    if (focusInside && opener && opener.isConnected) setTimeout(() => opener.focus(), 0);
  });
  const follow = () => {
    if (passageOpener && panel.matches(':popover-open')) placePassage(passageOpener);
  };
  window.addEventListener('resize', follow);
  window.addEventListener('scroll', follow, { passive: true });
}

// ---------------------------------------------------------------------------------------
// documents

const docs = { next: null, loading: false, again: false };

function documentItem(d) {
  const title = d.title || basename(d.source);
  const status = d.status || 'ready';
  const facts = [
    status !== 'ready' ? badge(status, status === 'failed' ? 'warn' : 'accent') : null,
    typeof d.chunks === 'number' ? h('span', {}, plural(d.chunks, 'chunk', 'chunks')) : null,
    d.collection ? h('span', {}, `· ${d.collection}`) : null,
    d.tags && d.tags.length ? h('span', {}, `· ${d.tags.join(', ')}`) : null,
  ];
  const del = status === 'ingesting' ? null : h('button', {
    type: 'button', class: 'icon delete', 'aria-label': `Delete ${title}`, title: 'Delete',
  }, svgIcon(ICON_TRASH));
  if (del) del.addEventListener('click', () => deleteDocument(d, del));
  return h('li', { dataset: { id: d.id, source: d.source } },
    h('div', {},
      h('span', { class: 'title' }, title),
      h('span', { class: 'where' }, d.source),
      h('span', { class: 'facts-line' }, ...facts),
      d.error ? h('span', { class: 'where' }, d.error) : null,
    ),
    del,
  );
}

async function loadDocuments({ more = false } = {}) {
  if (docs.loading) {
    // one more load after this one, so the list ends up current
    if (!more) docs.again = true;
    return;
  }
  docs.loading = true;
  const list = $('documents');
  const params = new URLSearchParams({ limit: '100' });
  if (settings.value.collection) params.set('collection', settings.value.collection);
  if (more && docs.next) params.set('after', docs.next);
  if (!more && !list.querySelector('li[data-id]')) $('docs-status').textContent = 'Loading documents…';
  try {
    const page = await apiJson(`/v1/documents?${params}`);
    if (!more) list.replaceChildren();
    for (const d of page.documents || []) list.append(documentItem(d));
    docs.next = page.next || null;
    $('more-docs').hidden = !docs.next;
    const n = list.children.length;
    $('docs-count').textContent = n ? `(${n}${docs.next ? '+' : ''})` : '';
    $('docs-status').textContent = '';
    if (!n) {
      list.append(h('li', { class: 'empty' }, settings.value.collection
        ? `No documents in the collection “${settings.value.collection}” yet.`
        : 'No documents yet. Drop files above to add some.'));
    }
  } catch (err) {
    const d = describe(err);
    const status = $('docs-status');
    status.replaceChildren(`Could not list the documents: ${d.text} `);
    if (err instanceof ApiError && err.status === 401) {
      const retry = h('button', { type: 'button', class: 'linkish' }, 'Enter an API key');
      retry.addEventListener('click', () => loadDocuments());
      status.append(retry);
    }
  } finally {
    docs.loading = false;
    if (docs.again) {
      docs.again = false;
      loadDocuments();
    }
  }
}

function confirmDelete(title, chunks) {
  const dialog = $('confirm');
  $('confirm-text').textContent = `“${title}” and its ${plural(chunks || 0, 'chunk', 'chunks')} will be removed from the index. This cannot be undone.`;
  return new Promise((resolve) => {
    dialog.returnValue = '';
    dialog.addEventListener('close', () => resolve(dialog.returnValue === 'delete'), { once: true });
    dialog.showModal();
  });
}

async function deleteDocument(d, button) {
  const title = d.title || basename(d.source);
  if (!(await confirmDelete(title, d.chunks))) {
    button.focus();
    return;
  }
  button.disabled = true;
  try {
    await api(`/v1/documents/${encodeURIComponent(d.id)}`, { method: 'DELETE' });
    const item = button.closest('li');
    const next = item && (item.nextElementSibling || item.previousElementSibling);
    if (item) item.remove();
    notify(`Deleted “${title}”.`);
    const focusTarget = next && next.querySelector('button.delete');
    (focusTarget || $('refresh-docs')).focus();
    loadDocuments();
    refreshReadiness();
  } catch (err) {
    button.disabled = false;
    notifyError(`Could not delete “${title}”`, err);
  }
}

// ---------------------------------------------------------------------------------------
// uploads

/** POST a form with upload progress (fetch has none); resolves to {status, text, retryAfter}. */
function postForm(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open('POST', path);
    for (const [k, v] of Object.entries(withKey())) xhr.setRequestHeader(k, v);
    xhr.upload.addEventListener('progress', (ev) => {
      if (ev.lengthComputable) onProgress(ev.loaded / ev.total);
    });
    xhr.addEventListener('load', () => resolve({
      status: xhr.status, text: xhr.responseText, retryAfter: xhr.getResponseHeader('retry-after'), statusText: xhr.statusText,
    }));
    xhr.addEventListener('error', () => reject(new Error('the upload failed (network error)')));
    xhr.addEventListener('abort', () => reject(new DOMException('aborted', 'AbortError')));
    xhr.send(form);
  });
}

async function upload(file, onProgress) {
  for (;;) {
    const form = new FormData();
    form.append('file', file, file.name);
    if (settings.value.collection) form.append('metadata', JSON.stringify({ collection: settings.value.collection }));
    const r = await postForm('/v1/documents', form, onProgress);
    if (r.status >= 200 && r.status < 300) return JSON.parse(r.text);
    const err = errorFrom(r.status, r.text, r.retryAfter, r.statusText);
    if (r.status === 401 && (await askForKey(err))) continue;
    throw err;
  }
}

const DOC_STATES = {
  queued: 'Waiting to be indexed…',
  done: 'Added',
  unchanged: 'Already indexed (unchanged)',
  deduplicated: 'Same content already indexed; this name was added to it',
};

function uploadRow(file) {
  const name = h('span', { class: 'file' }, file.name);
  const state = h('span', { class: 'state' }, 'Uploading…');
  const bar = h('progress', { max: '1', value: '0', 'aria-label': `Progress of ${file.name}` });
  const row = h('li', { class: 'upload', dataset: { state: 'uploading', file: file.name } },
    h('div', { class: 'line' }, name), state, bar);
  return {
    row,
    update(stateName, text, fraction) {
      row.dataset.state = stateName;
      state.textContent = text;
      if (fraction === null) bar.removeAttribute('value');
      else bar.value = Math.max(0, Math.min(1, fraction));
    },
    finish(ok) {
      bar.remove();
      const close = h('button', { type: 'button', class: 'icon', 'aria-label': `Dismiss ${file.name}` }, svgIcon(ICON_CLOSE));
      close.addEventListener('click', () => row.remove());
      row.querySelector('.line').append(close);
      if (ok) setTimeout(() => row.remove(), 8000);
    },
  };
}

async function followJob(jobId, ui) {
  for (;;) {
    const job = await apiJson(`/v1/jobs/${encodeURIComponent(jobId)}`);
    const d = (job.documents || [])[0] || {};
    const total = d.chunks_total || job.chunks_total || 0;
    const doneChunks = d.chunks_done ?? job.chunks_done ?? 0;
    if (job.status === 'failed' || d.status === 'failed') {
      return { ok: false, text: d.error ? `Failed: ${d.error}` : 'Failed' };
    }
    if (job.status === 'done') {
      const base = DOC_STATES[d.status] || 'Added';
      return { ok: true, text: d.status === 'done' && total ? `${base} (${plural(total, 'chunk', 'chunks')})` : base };
    }
    if (d.status === 'running' || job.status === 'running') {
      ui.update('indexing', total ? `Indexing: ${doneChunks} of ${plural(total, 'chunk', 'chunks')}` : 'Reading…', total ? doneChunks / total : null);
    } else {
      ui.update('indexing', DOC_STATES.queued, null);
    }
    await new Promise((r) => setTimeout(r, JOB_POLL_MS));
  }
}

async function uploadOne(file) {
  const ui = uploadRow(file);
  $('uploads').prepend(ui.row);
  try {
    const accepted = await upload(file, (f) => ui.update('uploading', `Uploading… ${Math.round(f * 100)} %`, f));
    ui.update('indexing', DOC_STATES.queued, null);
    loadDocuments();
    const result = await followJob(accepted.job_id, ui);
    ui.update(result.ok ? 'done' : 'failed', result.text, 1);
    ui.finish(result.ok);
    notify(`${file.name}: ${result.text}`, { error: !result.ok });
  } catch (err) {
    const d = describe(err);
    ui.update('failed', d.text, 0);
    ui.finish(false);
    notify(`${file.name} was not added: ${d.text}`, { error: true, code: d.code });
  }
  loadDocuments();
  refreshReadiness();
}

function wireUploads() {
  const zone = $('dropzone');
  const input = $('file-input');
  input.addEventListener('change', () => {
    for (const f of input.files) uploadOne(f);
    input.value = '';
  });
  let depth = 0;
  zone.addEventListener('dragenter', (ev) => {
    ev.preventDefault();
    depth += 1;
    zone.classList.add('over');
  });
  zone.addEventListener('dragover', (ev) => {
    ev.preventDefault();
    if (ev.dataTransfer) ev.dataTransfer.dropEffect = 'copy';
  });
  zone.addEventListener('dragleave', () => {
    depth = Math.max(0, depth - 1);
    if (!depth) zone.classList.remove('over');
  });
  zone.addEventListener('drop', (ev) => {
    ev.preventDefault();
    depth = 0;
    zone.classList.remove('over');
    const files = ev.dataTransfer ? [...ev.dataTransfer.files] : [];
    if (!files.length) {
      notify('Drop files (folders are not uploaded).');
      return;
    }
    for (const f of files) uploadOne(f);
  });
  // a file dropped beside the zone must not replace the page
  for (const type of ['dragover', 'drop']) {
    window.addEventListener(type, (ev) => {
      if (!zone.contains(ev.target)) ev.preventDefault();
    });
  }
  // a click anywhere on the zone opens the file chooser (the keyboard reaches the input)
  zone.addEventListener('click', (ev) => {
    if (ev.target === zone) input.click();
  });
  $('refresh-docs').addEventListener('click', () => loadDocuments());
  $('more-docs').addEventListener('click', () => loadDocuments({ more: true }));
}

// ---------------------------------------------------------------------------------------
// readiness

async function refreshReadiness() {
  const el = $('readiness');
  try {
    const res = await fetch('/readyz');
    const body = await res.json().catch(() => ({}));
    if (res.ok) {
      el.dataset.state = 'ready';
      $('readiness-text').textContent = `Ready · ${plural(body.chunks || 0, 'chunk', 'chunks')} indexed`;
    } else {
      el.dataset.state = 'down';
      $('readiness-text').textContent = (body.error && body.error.message) || 'Not ready';
    }
  } catch {
    el.dataset.state = 'down';
    $('readiness-text').textContent = 'Server unreachable';
  }
}

// ---------------------------------------------------------------------------------------

function start() {
  settings.load();
  showSettingsSummary();
  showKeyState();
  wireSettings();
  wireAsk();
  wirePassage();
  wireUploads();
  $('forget-key').addEventListener('click', () => {
    keys.forget();
    notify('The API key is forgotten in this browser.');
    loadDocuments();
  });
  refreshReadiness();
  loadDocuments();
}

start();

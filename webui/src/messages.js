// One message of the conversation as an element. A user's text is shown as text; an
// answer's markdown is rendered and sanitized (markdown.js), its reasoning folded, its tool
// calls listed, and its token accounting (the server's timings) under it.

import { el, fmtInt } from './dom.js';
import { renderMarkdown } from './markdown.js';

export function statsText(s) {
  if (!s) return '';
  const parts = [];
  if (s.slot !== undefined) parts.push(`slot ${s.slot}`);
  if (s.cache_n !== undefined) parts.push(`${fmtInt(s.cache_n)} prompt tokens from cache, ${fmtInt(s.prompt_n)} computed`);
  if (s.predicted_n !== undefined) parts.push(`${fmtInt(s.predicted_n)} generated`);
  if (s.predicted_per_second) parts.push(`${s.predicted_per_second.toFixed(1)} tokens/s`);
  return parts.join(' · ');
}

function userView(msg, index, on) {
  const body = el('div', { class: 'content plain', text: msg.content });
  const images = (msg.images || []).map((u, i) =>
    el('img', { class: 'thumb', src: u, alt: `Image ${i + 1}`, 'data-testid': 'message-image' }));
  const edit = el('button', { type: 'button', class: 'small', 'data-testid': 'edit', text: 'Edit', 'aria-label': `Edit message ${index + 1}` });
  const art = el('article', { class: 'msg user', 'data-testid': 'message-user', 'data-index': index },
    el('h3', { class: 'who', text: 'You' }), images.length ? el('div', { class: 'images' }, ...images) : null,
    body, el('div', { class: 'actions' }, edit));
  edit.addEventListener('click', () => startEdit(art, body, msg, index, on));
  return art;
}

// The message turns into a text box; Save sends the edited text (the conversation is cut
// after it: the earlier messages are sent unchanged, so their cached prefix is reused).
function startEdit(art, body, msg, index, on) {
  if (on.busy()) return;
  const box = el('textarea', { class: 'edit-box', rows: 4, 'aria-label': 'Edited message', 'data-testid': 'edit-input' });
  box.value = msg.content;
  const save = el('button', { type: 'submit', class: 'primary small', 'data-testid': 'edit-send', text: 'Save and send' });
  const cancel = el('button', { type: 'button', class: 'small', text: 'Cancel' });
  const form = el('form', { class: 'edit' }, box, el('div', { class: 'actions' }, save, cancel));
  const done = () => { form.replaceWith(body); art.querySelector('.actions').hidden = false; };
  form.addEventListener('submit', (e) => { e.preventDefault(); on.resend(index, box.value); });
  cancel.addEventListener('click', done);
  box.addEventListener('keydown', (e) => { if (e.key === 'Escape') { e.preventDefault(); done(); } });
  art.querySelector('.actions').hidden = true;
  body.replaceWith(form);
  box.focus();
}

function toolCallsView(calls) {
  return el('div', { class: 'tool-calls' }, ...calls.map((c) =>
    el('div', { class: 'tool-call', 'data-testid': 'tool-call' },
      el('div', { class: 'tool-name', text: `Tool call: ${c.function.name}` }),
      el('pre', { class: 'tool-args', text: c.function.arguments }))));
}

// Fills (or refills, while streaming) an answer's element from ``msg``.
export function fillAssistant(art, msg, streaming) {
  art.dataset.state = streaming ? 'streaming' : msg.state || 'done';
  art.setAttribute('aria-busy', streaming ? 'true' : 'false');
  const parts = [el('h3', { class: 'who', text: 'Assistant' })];
  if (msg.reasoning) {
    const d = el('details', { class: 'reasoning', 'data-testid': 'reasoning' },
      el('summary', { text: streaming && !msg.content ? 'Reasoning…' : 'Reasoning' }),
      el('div', { class: 'plain', text: msg.reasoning }));
    const was = art.querySelector('details.reasoning');
    if (was && was.open) d.open = true;
    parts.push(d);
  }
  const content = el('div', { class: 'content markdown' });
  content.innerHTML = renderMarkdown(msg.content); // sanitized (markdown.js)
  parts.push(content);
  if (msg.tool_calls && msg.tool_calls.length) parts.push(toolCallsView(msg.tool_calls));
  if (msg.state === 'stopped') parts.push(el('p', { class: 'note', text: 'Stopped.' }));
  if (msg.state === 'done' && msg.finish === 'length') parts.push(el('p', { class: 'note', 'data-testid': 'cut-note', text: 'Cut at the max tokens limit (Settings).' }));
  if (msg.state === 'error') parts.push(el('p', { class: 'error', role: 'alert', text: msg.error || 'The request failed.' }));
  parts.push(el('p', { class: 'stats', 'data-testid': 'message-stats', text: statsText(msg.stats) }));
  const actions = art.querySelector('.actions');
  art.replaceChildren(...parts);
  if (actions) art.append(actions);
}

export function assistantView(msg, index, on, last) {
  const art = el('article', { class: 'msg assistant', 'data-testid': 'message-assistant', 'data-index': index });
  fillAssistant(art, msg, false);
  if (last) {
    const regen = el('button', { type: 'button', class: 'small', 'data-testid': 'regenerate', text: 'Regenerate' });
    regen.addEventListener('click', () => on.regenerate());
    art.append(el('div', { class: 'actions' }, regen));
  }
  return art;
}

export function messageView(msg, index, on, last) {
  if (msg.role === 'user') return userView(msg, index, on);
  if (msg.role === 'assistant') return assistantView(msg, index, on, last);
  return el('article', { class: `msg ${msg.role}` }, el('h3', { class: 'who', text: msg.role }),
    el('div', { class: 'content plain', text: msg.content }));
}

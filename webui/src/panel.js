// The cache panel: for each answer of the conversation (stopped ones too), its prompt
// tokens served from the cache and computed (the server's timings: cache_n, prompt_n),
// tokens per second and the slot it ran on; and a live view of GET /slots and GET /cache, refreshed every 2 s while
// the page is visible (paused while it is hidden).

import { getJSON } from './api.js';
import { $, el, fmtBytes, fmtInt } from './dom.js';

const REFRESH_MS = 2000;

// A stopped answer is listed too, with the figures of the last chunk that came before the
// stop (every chunk carries the run's timings so far); stopped before any: dashes.
export function renderTurns(conv) {
  const rows = [];
  let turn = 0;
  for (const m of conv ? conv.messages : []) {
    if (m.role !== 'assistant') continue;
    turn++;
    const s = m.stats || {};
    const stopped = m.state === 'stopped';
    const known = typeof s.cache_n === 'number' && typeof s.prompt_n === 'number';
    if (!known && !stopped) continue;
    const total = known ? s.cache_n + s.prompt_n : 0;
    const share = total ? s.cache_n / total : 0;
    const meter = known
      ? [el('meter', { min: 0, max: 1, value: share.toFixed(3), 'aria-label': `turn ${turn}: ${Math.round(share * 100)}% from cache` }), ` ${Math.round(share * 100)}%`]
      : ['–'];
    const label = el('th', { scope: 'row', text: String(turn) });
    if (stopped) label.append(' ', el('span', { class: 'tag', 'data-testid': 'turn-stopped', text: 'stopped' }));
    rows.push(el('tr', { 'data-testid': 'cache-turn', 'data-turn': turn, 'data-state': m.state || 'done', 'data-cache-n': known ? s.cache_n : '', 'data-prompt-n': known ? s.prompt_n : '', 'data-slot': s.slot ?? '' },
      label,
      el('td', { text: s.slot ?? '–' }),
      el('td', { class: 'num', 'data-testid': 'turn-cache-n', text: fmtInt(s.cache_n) }),
      el('td', { class: 'num', 'data-testid': 'turn-prompt-n', text: fmtInt(s.prompt_n) }),
      el('td', {}, ...meter),
      el('td', { class: 'num', text: s.predicted_per_second ? s.predicted_per_second.toFixed(1) : '–' })));
  }
  if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 6, class: 'hint', text: 'No answers yet.' })));
  $('turns-body').replaceChildren(...rows);
}

function slotRows(slots) {
  return slots.map((s) =>
    el('tr', { 'data-testid': 'slot-row', 'data-slot': s.id, 'data-n-tokens': s.n_tokens },
      el('th', { scope: 'row', text: String(s.id) }),
      el('td', { text: s.is_processing ? `${s.state} (task ${s.id_task})` : s.state }),
      el('td', { class: 'num', text: `${fmtInt(s.n_tokens)} / ${fmtInt(s.n_ctx)}` }),
      el('td', { class: 'num', text: `${fmtInt(s.n_prompt_tokens_cache)} / ${fmtInt(s.n_prompt_tokens_processed)}` })));
}

function cacheItems(c) {
  const dl = [];
  const item = (k, v) => dl.push(el('dt', { text: k }), el('dd', { text: v }));
  if (!c.enabled) {
    item('RAM cache', 'off (--cache-ram 0)');
    return dl;
  }
  const rc = c.counters || {};
  item('RAM entries', `${fmtInt(c.n_entries)} (${fmtInt(c.n_tokens)} tokens, ${fmtBytes(c.n_bytes)}${c.limit_bytes > 0 ? ' of ' + fmtBytes(c.limit_bytes) : ''})`);
  item('RAM hits / misses', `${fmtInt(rc.loads)} / ${fmtInt(rc.misses)} (${fmtInt(rc.tokens_restored)} tokens restored)`);
  item('RAM saves / evictions', `${fmtInt(rc.saves)} / ${fmtInt(rc.evictions)}`);
  const d = c.disk || {};
  if (!d.enabled) item('Disk tier', 'off (--cache-disk)');
  else {
    const dc = d.counters || {};
    item('Disk entries', `${fmtInt(d.n_entries)} (${fmtBytes(d.n_bytes)} of ${fmtBytes(d.limit_bytes)})`);
    item('Disk hits / misses', `${fmtInt(dc.hits)} / ${fmtInt(dc.misses)}`);
    item('Disk writes', `${fmtInt(dc.writes)} (${fmtBytes(dc.bytes_written)})`);
  }
  return dl;
}

async function refresh(query) {
  const q = query();
  const [slots, cache] = await Promise.allSettled([getJSON('/slots' + q), getJSON('/cache' + q)]);
  if (slots.status === 'fulfilled') $('slots-body').replaceChildren(...slotRows(slots.value));
  else $('slots-body').replaceChildren(el('tr', {}, el('td', { colspan: 4, class: 'hint', text: `not available: ${slots.reason.message}` })));
  if (cache.status === 'fulfilled') $('cache-info').replaceChildren(...cacheItems(cache.value));
  else $('cache-info').replaceChildren(el('dt', { text: 'Cache' }), el('dd', { text: `not available: ${cache.reason.message}` }));
  $('live-state').textContent = `(live, ${new Date().toLocaleTimeString('en-GB')})`;
}

// Starts the live view; ``query()`` gives the query string (router mode: ?model=...),
// ``extra()`` runs on each tick too (router mode: the model list). Returns a function that
// refreshes now.
export function startLive(query, extra) {
  let running = false;
  const tick = async () => {
    if (document.hidden || running) return;
    running = true;
    try {
      await Promise.allSettled([refresh(query), extra()]);
    } finally {
      running = false;
    }
  };
  setInterval(tick, REFRESH_MS);
  document.addEventListener('visibilitychange', () => {
    if (document.hidden) $('live-state').textContent = '(paused)';
    else tick();
  });
  tick();
  return tick;
}

// A model's answer as HTML: marked (CommonMark + GFM) writes it, highlight.js colours the
// code blocks whose language it knows, and DOMPurify sanitizes the result last, so nothing
// the model writes (raw HTML included) reaches the page unsanitized. The page's
// Content-Security-Policy (no inline script, same-origin only) is the second wall.
//
// Why these: marked and DOMPurify are maintained, widely used and small (50 and 31 KB of
// the bundle, minified); DOMPurify is the sanitizer browsers' own Sanitizer API was modelled
// on. highlight.js: its core and the 17 languages below are 95 KB, registered one by one (no
// grammar build step); Prism's last release is from 2023 (1.30), and Shiki ships a WASM
// regex engine and grammars of several MB.

import { Marked } from 'marked';
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import markdown from 'highlight.js/lib/languages/markdown';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql, typescript, xml, yaml };
for (const [name, lang] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, lang);

const escapeHtml = (s) =>
  s.replace(/[&<>"']/g, (ch) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[ch]);

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    code({ text, lang }) {
      const name = ((lang || '').match(/^[\w+#.-]*/) || [''])[0].toLowerCase();
      const known = name && hljs.getLanguage(name);
      const body = known ? hljs.highlight(text, { language: name, ignoreIllegals: true }).value : escapeHtml(text);
      const cls = known ? ` class="hljs language-${name}"` : ' class="hljs"';
      return `<pre><code${cls}>${body}</code></pre>\n`;
    },
  },
});

// What an answer may contain: text formatting, lists, tables, code, links. No images
// (a crafted one could send the conversation to any URL this origin serves), no forms,
// frames, media or styles; no data-* attributes; ids prefixed (DOM clobbering).
const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ['img', 'picture', 'source', 'video', 'audio', 'track', 'style', 'form', 'input', 'button',
    'textarea', 'select', 'option', 'iframe', 'frame', 'object', 'embed', 'link', 'meta', 'base', 'dialog'],
  FORBID_ATTR: ['style', 'srcset', 'action', 'formaction', 'ping'],
  ALLOW_DATA_ATTR: false,
  SANITIZE_NAMED_PROPS: true,
};

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
});

export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || '', { async: false }), PURIFY);
}

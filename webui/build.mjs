// Builds the chat page into a folder (default ../server/webui/static): app.js (the
// scripts and their libraries, one bundle), app.css, index.html and favicon.svg.
// Deterministic: pinned versions (package-lock.json), no timestamps, no source maps, the
// same esbuild options every time; ./build.sh --check compares a fresh build with the
// shipped files.
import { build } from 'esbuild';
import { copyFileSync, mkdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] || join(here, '..', 'server', 'webui', 'static'));
mkdirSync(out, { recursive: true });

const common = { bundle: true, minify: true, legalComments: 'eof', charset: 'utf8', logLevel: 'warning', absWorkingDir: here };
await build({
  ...common,
  entryPoints: ['src/main.js'],
  outfile: join(out, 'app.js'),
  format: 'iife',
  target: ['chrome109', 'firefox115', 'safari16'],
});
await build({ ...common, entryPoints: ['src/style.css'], outfile: join(out, 'app.css'), target: ['chrome109', 'firefox115', 'safari16'] });
for (const name of ['index.html', 'favicon.svg']) copyFileSync(join(here, 'src', name), join(out, name));

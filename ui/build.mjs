// build.mjs bundles the web view into ../server/webui/dist (or the directory its argument
// names): index.html and, under assets/,
// one script and one style sheet named by the hash of their contents (served as immutable).
// The same sources give the same bytes: no time stamps, no absolute paths, no source maps.
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import * as esbuild from 'esbuild';

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2] ? resolve(process.argv[2]) : join(here, '..', 'server', 'webui', 'dist');

const result = await esbuild.build({
  absWorkingDir: here,
  entryPoints: ['src/main.jsx'],
  bundle: true,
  format: 'esm',
  target: ['es2022'],
  minify: true,
  legalComments: 'eof',
  charset: 'utf8',
  jsx: 'automatic',
  jsxImportSource: 'preact',
  entryNames: '[name]-[hash]',
  assetNames: '[name]-[hash]',
  outdir: 'build/assets',
  write: false,
  metafile: true,
  logLevel: 'warning',
});

await rm(out, { recursive: true, force: true });
await mkdir(join(out, 'assets'), { recursive: true });
const names = {};
for (const f of result.outputFiles) {
  const name = basename(f.path);
  if (name.endsWith('.js')) names.JS = name;
  if (name.endsWith('.css')) names.CSS = name;
  await writeFile(join(out, 'assets', name), f.contents);
}
if (!names.JS || !names.CSS) throw new Error(`the bundle lacks a script or a style sheet: ${Object.keys(names)}`);
const page = (await readFile(join(here, 'index.html'), 'utf8'))
  .replace('{{JS}}', `assets/${names.JS}`)
  .replace('{{CSS}}', `assets/${names.CSS}`);
await writeFile(join(out, 'index.html'), page);
console.log(`webui: ${names.JS} and ${names.CSS} in ${out}`);

'use strict';
// The evaluator behind the JavaScript kernel of the code-interpreter server
// (agentenv.guest.codeint.jskernel): one Node.js process per context. Requests come on a socket to
// the kernel (the descriptor in AENV_CONTROL_FD), one JSON line each, {"code": ...}; the reply is one JSON line,
// {"status": "ok", "data": {"text/plain": ...} | null} or {"status": "error", "ename", "evalue",
// "traceback": [...]}. console output goes to this process's real stdout and stderr, which the
// kernel streams; stdout and stderr are pipes, written synchronously, so everything a cell printed
// is in them before its reply is sent.
//
// Cells run in this process's own global context, so what one defines the next one sees. A cell
// with neither a top-level `await` nor an `import` runs as a script as it is (its `let` and
// `const` stay script-scoped bindings, its value is the script's completion value). One with
// either is rewritten with acorn (Debian's node-acorn, which Debian's Node.js itself uses) into an
// async function whose top-level declarations become assignments to globals, whose imports
// become dynamic imports resolved from the working directory, and which returns its last
// expression, as Node's REPL does for `await`.

const net = require('net');
const path = require('path');
const util = require('util');
const vm = require('vm');
const { builtinModules, createRequire } = require('module');
const { pathToFileURL } = require('url');

function loadAcorn() {
  for (const where of ['acorn', '/usr/share/nodejs/acorn']) {
    try {
      return require(where);
    } catch (err) {
      // next
    }
  }
  return null;
}

const acorn = loadAcorn();
// The TypeScript kernel is this evaluator with AENV_JS_TYPESCRIPT=1: each cell is transpiled
// first with TypeScript's transpileModule (Debian's node-typescript), types stripped and not
// checked, as E2B's TypeScript kernel (Deno's) runs cells; a syntax error is the cell's error.
const typescript = process.env.AENV_JS_TYPESCRIPT === '1' ? loadTypeScript() : null;
delete process.env.AENV_JS_TYPESCRIPT; // not the user's
function loadTypeScript() {
  for (const where of ['typescript', '/usr/share/nodejs/typescript']) {
    try {
      return require(where);
    } catch (err) {
      // next
    }
  }
  throw new Error('TypeScript (node-typescript) is not installed');
}

const TS_OPTIONS = typescript === null ? null : {
  target: typescript.ScriptTarget.ES2022,
  module: typescript.ModuleKind.ESNext,
  // an import whose names a later cell uses is kept even if this cell does not use them
  preserveValueImports: true,
  isolatedModules: true,
  useDefineForClassFields: true,
};

function transpileOnce(source) {
  const out = typescript.transpileModule(source, {
    compilerOptions: TS_OPTIONS, reportDiagnostics: true, fileName: 'cell.ts',
  });
  return { code: out.outputText, diagnostics: out.diagnostics || [] };
}

// A TypeScript cell as JavaScript: its syntax errors thrown as a SyntaxError.
function transpile(source) {
  if (/^\s*\{/.test(source) && /\}\s*;?\s*$/.test(source)) {
    // an object literal typed alone (see objectLiteral below), types and all
    const wrapped = transpileOnce(`(${source.replace(/;\s*$/, '')})`);
    if (wrapped.diagnostics.length === 0) return wrapped.code;
  }
  const { code, diagnostics } = transpileOnce(source);
  if (diagnostics.length > 0) {
    const first = diagnostics[0];
    const text = typescript.flattenDiagnosticMessageText(first.messageText, '\n');
    let where = '';
    if (first.file && first.start !== undefined) {
      const { line, character } = first.file.getLineAndCharacterOfPosition(first.start);
      where = ` (${line + 1}:${character + 1})`;
    }
    const err = new SyntaxError(`${text}${where}`);
    err.stack = `SyntaxError: TS${first.code}: ${text}${where}`;
    throw err;
  }
  // the marker TypeScript adds to a file it sees as a module (a type-only import): not a
  // statement a cell can run
  return code.replace(/^export \{\};\s*$/m, '');
}

const IMPORT = Symbol.for('agentenv.import');
let cellNumber = 0;
let pending = null; // {reject} of the cell awaiting a promise, for SIGINT

// `require` in a cell resolves from the working directory (as in a script there), not from here.
function cwdRequire() {
  return createRequire(path.join(process.cwd(), '[cell]'));
}
function cellRequire(id) {
  return cwdRequire()(id);
}
cellRequire.resolve = (id, options) => cwdRequire().resolve(id, options);
Object.defineProperty(cellRequire, 'cache', { get: () => require.cache });
globalThis.require = cellRequire;

globalThis[IMPORT] = async (specifier) => {
  if (specifier.startsWith('node:') || builtinModules.includes(specifier)) {
    return import(specifier);
  }
  let resolved;
  try {
    resolved = cellRequire.resolve(specifier);
  } catch (err) {
    return import(specifier); // e.g. an ES-only package whose exports have no require entry
  }
  return import(pathToFileURL(resolved).href);
};

// A program's top level: does it await, does it import? (Functions are not looked into.)
function topLevelFeatures(program) {
  const found = { await: false, import: false };
  const visit = (node) => {
    if (!node || typeof node.type !== 'string' || (found.await && found.import)) return;
    switch (node.type) {
      case 'FunctionDeclaration':
      case 'FunctionExpression':
      case 'ArrowFunctionExpression':
        return;
      case 'AwaitExpression':
        found.await = true;
        break;
      case 'ForOfStatement':
        if (node.await) found.await = true;
        break;
      case 'ImportDeclaration':
        found.import = true;
        return;
      default:
        break;
    }
    for (const key of Object.keys(node)) {
      const value = node[key];
      if (Array.isArray(value)) value.forEach(visit);
      else if (value && typeof value === 'object') visit(value);
    }
  };
  visit(program);
  return found;
}

// import() in a script run by vm needs a flag (--experimental-vm-modules) for its callback:
// a cell's import() calls are made calls of the same resolver its import statements use.
function dynamicImports(program) {
  const found = [];
  const visit = (node) => {
    if (!node || typeof node.type !== 'string') return;
    if (node.type === 'ImportExpression') found.push(node);
    for (const key of Object.keys(node)) {
      const value = node[key];
      if (Array.isArray(value)) value.forEach(visit);
      else if (value && typeof value === 'object') visit(value);
    }
  };
  visit(program);
  return found;
}

function hasDynamicImport(program) {
  return dynamicImports(program).length > 0;
}

function withDynamicImports(code, program) {
  let out = code;
  for (const node of dynamicImports(program).sort((a, b) => b.start - a.start)) {
    const keyword = node.start + 'import'.length;
    out = `${out.slice(0, node.start)}globalThis[Symbol.for('agentenv.import')]${out.slice(keyword)}`;
  }
  return out;
}

function importStatement(code, node) {
  const source = JSON.stringify(node.source.value);
  const sets = node.specifiers.map((spec) => {
    const local = spec.local.name;
    if (spec.type === 'ImportDefaultSpecifier') return `${local} = m.default;`;
    if (spec.type === 'ImportNamespaceSpecifier') return `${local} = m;`;
    const imported = spec.imported.type === 'Identifier' ? spec.imported.name : spec.imported.value;
    return `${local} = m[${JSON.stringify(imported)}];`;
  });
  return `await globalThis[Symbol.for('agentenv.import')](${source}).then((m) => { ${sets.join(' ')} });`;
}

// The rewrite for a cell with a top-level await or import (see the top of the file).
function asAsyncFunction(code, program) {
  const edits = []; // [start, end, text], applied from the end
  const hoisted = [];
  const body = program.body;
  body.forEach((node, index) => {
    const src = code.slice(node.start, node.end);
    const last = index === body.length - 1;
    switch (node.type) {
      case 'ImportDeclaration':
        edits.push([node.start, node.end, importStatement(code, node)]);
        break;
      case 'VariableDeclaration': {
        const parts = node.declarations.map((decl) => {
          const target = code.slice(decl.id.start, decl.id.end);
          const value = decl.init ? code.slice(decl.init.start, decl.init.end) : 'undefined';
          return `(${target} = ${value})`;
        });
        edits.push([node.start, node.end, `void (${parts.join(', ')});`]);
        break;
      }
      case 'FunctionDeclaration':
        // declarations are hoisted: assigned before anything else runs
        hoisted.push(`${node.id.name} = ${src};`);
        edits.push([node.start, node.end, '']);
        break;
      case 'ClassDeclaration':
        edits.push([node.start, node.end, `${node.id.name} = ${src};`]);
        break;
      case 'ExpressionStatement':
        if (last) {
          const expr = code.slice(node.expression.start, node.expression.end);
          edits.push([node.start, node.end, `return (${expr});`]);
        }
        break;
      default:
        break;
    }
  });
  let out = code;
  for (const [start, end, text] of edits.sort((a, b) => b[0] - a[0])) {
    out = out.slice(0, start) + text + out.slice(end);
  }
  return `(async () => { ${hoisted.join(' ')}\n${out}\n})()`;
}

function parse(code) {
  if (acorn === null) return null;
  try {
    return acorn.parse(code, {
      ecmaVersion: 'latest', sourceType: 'script', allowAwaitOutsideFunction: true,
      allowImportExportEverywhere: true, allowHashBang: true,
    });
  } catch (err) {
    return null; // run as it is: V8 reports the syntax error
  }
}

// An object literal typed alone is a block to the parser; Node's REPL reads it as the object.
function objectLiteral(code) {
  if (!/^\s*\{/.test(code) || !/\}\s*;?\s*$/.test(code)) return null;
  const wrapped = `(${code.replace(/;\s*$/, '')})`;
  try {
    new vm.Script(wrapped); // eslint-disable-line no-new
    return wrapped;
  } catch (err) {
    return null;
  }
}

function interruptible(promise) {
  return new Promise((resolve, reject) => {
    pending = { reject };
    promise.then(resolve, reject).finally(() => { pending = null; });
  });
}

async function evaluate(source) {
  cellNumber += 1;
  let code = typescript === null ? source : transpile(source);
  const filename = `<cell ${cellNumber}>`;
  const options = { filename, breakOnSigint: true };
  let program = parse(code);
  if (program && hasDynamicImport(program)) {
    code = withDynamicImports(code, program);
    program = parse(code);
  }
  const features = program ? topLevelFeatures(program) : { await: false, import: false };
  if (features.await || features.import) {
    return interruptible(vm.runInThisContext(asAsyncFunction(code, program), options));
  }
  const value = vm.runInThisContext(objectLiteral(code) || code, options);
  // a promise as the cell's value is awaited (so `fetch(url)` gives the response)
  return value instanceof Promise ? interruptible(value) : value;
}

function cleanStack(stack) {
  return String(stack).split('\n').filter((line) => !line.includes(__filename)
    && !/\(node:[a-z_/]+:\d+:\d+\)$/.test(line)).join('\n');
}

function errorReply(err) {
  if (err instanceof Error || (err && typeof err === 'object' && 'stack' in err)) {
    const name = err.name || (err.constructor && err.constructor.name) || 'Error';
    return { status: 'error', ename: name, evalue: String(err.message ?? ''),
      traceback: cleanStack(err.stack || `${name}: ${err.message}`).split('\n') };
  }
  const text = util.inspect(err);
  return { status: 'error', ename: 'Error', evalue: text, traceback: [`Uncaught ${text}`] };
}

function okReply(value) {
  if (value === undefined) return { status: 'ok', data: null };
  return { status: 'ok', data: { 'text/plain': util.inspect(value, { colors: false }) } };
}

// A SIGINT while a cell awaits ends that cell (one that runs synchronously is stopped by
// breakOnSigint instead); between cells it is ignored rather than ending the process.
process.on('SIGINT', () => {
  if (pending !== null) {
    const err = new Error('Script execution was interrupted by `SIGINT`');
    err.name = 'KeyboardInterrupt';
    pending.reject(err);
  }
});
// What a callback throws after its cell ended is reported, not fatal.
process.on('uncaughtException', (err) => {
  process.stderr.write(`Uncaught ${cleanStack(err && err.stack ? err.stack : util.inspect(err))}\n`);
});
process.on('unhandledRejection', (reason) => {
  process.stderr.write(`Unhandled rejection: ${reason && reason.stack ? cleanStack(reason.stack) : util.inspect(reason)}\n`);
});

const control = new net.Socket({ fd: Number(process.env.AENV_CONTROL_FD), readable: true, writable: true });
delete process.env.AENV_CONTROL_FD; // not the user's
let buffered = '';
let queue = Promise.resolve();
control.setEncoding('utf8');
control.on('data', (chunk) => {
  buffered += chunk;
  let newline = buffered.indexOf('\n');
  while (newline >= 0) {
    const line = buffered.slice(0, newline);
    buffered = buffered.slice(newline + 1);
    newline = buffered.indexOf('\n');
    queue = queue.then(async () => {
      let reply;
      try {
        reply = okReply(await evaluate(JSON.parse(line).code));
      } catch (err) {
        reply = errorReply(err);
      }
      control.write(`${JSON.stringify(reply)}\n`);
    });
  }
});
control.on('end', () => process.exit(0));
control.on('error', () => process.exit(0));
control.write('{"status": "ready"}\n');

// Drives the E2B Code Interpreter JS SDK (npm `@e2b/code-interpreter`, pinned in package.json)
// against a VM node's code-interpreter-v1 template. Configured only by environment, as a user
// would: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, plus AENV_TS_MODULES (the directory whose
// node_modules holds the SDK). Prints one JSON object (the observations) on stdout;
// test_code_interpreter.py asserts on it.
import { createRequire } from 'node:module'
import { readFileSync } from 'node:fs'
import path from 'node:path'

const modules = process.env.AENV_TS_MODULES
const require = createRequire(path.join(modules, 'package.json'))
const { Sandbox } = require('@e2b/code-interpreter')
const sdkPackage = path.join(modules, 'node_modules', '@e2b', 'code-interpreter', 'package.json')

const seen = { sdkVersion: JSON.parse(readFileSync(sdkPackage, 'utf8')).version }
const sbx = await Sandbox.create({ timeoutMs: 300_000 })
seen.sandboxId = sbx.sandboxId
try {
  const first = await sbx.runCode('x = 1')
  seen.assign = { error: first.error ?? null, results: first.results.length }
  const second = await sbx.runCode('x + 1')
  seen.sum = { text: second.text, error: second.error ?? null }
  seen.counts = [first.executionCount, second.executionCount]

  const lines = []
  const printed = await sbx.runCode(
    "import sys\nfor i in range(3):\n    print('line', i)\nprint('oops', file=sys.stderr)",
    {
      onStdout: (m) => lines.push(['out', m.line]),
      onStderr: (m) => lines.push(['err', m.line]),
    },
  )
  seen.callbacks = lines
  seen.logs = printed.logs

  const failed = await sbx.runCode("def f():\n    raise ValueError('bad value')\nf()")
  seen.error = failed.error
    ? { name: failed.error.name, value: failed.error.value, traceback: failed.error.traceback }
    : null

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  seen.context = { cwd: ctx.cwd, language: ctx.language }
  seen.cwdInContext = (await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text
  await sbx.runCode('z = 7', { context: ctx })
  seen.zInContext = (await sbx.runCode('z', { context: ctx })).text
  seen.zInDefault = (await sbx.runCode("'z' in globals()")).text
  seen.listedBefore = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
  await sbx.removeCodeContext(ctx)
  seen.listedAfter = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)

  const plot = await sbx.runCode(
    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('Squares')\nplt.show()",
  )
  seen.plot = {
    error: plot.error ?? null,
    results: plot.results.map((r) => ({
      formats: r.formats(),
      pngMagic: r.png ? Buffer.from(r.png, 'base64').subarray(0, 8).toString('hex') : null,
      chartTitle: r.chart?.title ?? null,
    })),
  }
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(seen))

// Drives the official E2B TypeScript SDK (npm `e2b`, pinned in package.json) against a node.
// Configured only by environment, as a user would: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
// plus AENV_TS_MODULES (the directory whose node_modules holds the SDK).
// Prints one JSON object (the observations) on stdout; test_ts_sdk.py asserts on it.
import { createRequire } from 'node:module'
import { readFileSync } from 'node:fs'
import path from 'node:path'

const require = createRequire(path.join(process.env.AENV_TS_MODULES, 'package.json'))
const { Sandbox, NotFoundError, SandboxNotFoundError, SandboxError } = require('e2b')
const sdkPackage = path.join(process.env.AENV_TS_MODULES, 'node_modules', 'e2b', 'package.json')

const seen = { sdkVersion: JSON.parse(readFileSync(sdkPackage, 'utf8')).version }
const sbx = await Sandbox.create('base', {
  timeoutMs: 120_000,
  metadata: { suite: 'ts-sdk' },
  envs: { FOO: 'from-ts' },
})
seen.sandboxId = sbx.sandboxId
try {
  const run = await sbx.commands.run('echo hi; echo $FOO; echo err >&2')
  seen.run = { stdout: run.stdout, stderr: run.stderr, exitCode: run.exitCode }

  try {
    await sbx.commands.run('exit 3')
    seen.exit3 = 'no error'
  } catch (err) {
    seen.exit3 = { name: err.constructor.name, exitCode: err.exitCode }
  }

  const text = 'hello from typescript\n'
  const binary = new Uint8Array(70_000).map((_, i) => (i * 7) % 256)
  seen.writeText = await sbx.files.write('/home/user/ts.txt', text)
  await sbx.files.write('/home/user/ts.bin', binary.buffer)
  seen.readText = await sbx.files.read('/home/user/ts.txt')
  const back = await sbx.files.read('/home/user/ts.bin', { format: 'bytes' })
  seen.binaryRoundTrip = back.length === binary.length && back.every((b, i) => b === binary[i])

  const info = await sbx.getInfo()
  seen.infoBefore = { state: info.state, metadata: info.metadata, templateId: info.templateId }

  seen.pause = await sbx.pause()
  seen.pauseAgain = await Sandbox.pause(sbx.sandboxId)
  seen.stateWhilePaused = (await Sandbox.getInfo(sbx.sandboxId)).state
  seen.runningWhilePaused = await sbx.isRunning()

  const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
  seen.stateAfterConnect = (await resumed.getInfo()).state
  seen.readAfterResume = await resumed.files.read('/home/user/ts.txt')
  seen.runAfterResume = (await resumed.commands.run('cat /home/user/ts.txt | wc -c')).stdout
} finally {
  seen.kill = await sbx.kill()
}
seen.killAgain = await Sandbox.kill(sbx.sandboxId)
seen.runningAfterKill = await sbx.isRunning()
try {
  await Sandbox.connect(sbx.sandboxId)
  seen.connectAfterKill = 'no error'
} catch (err) {
  seen.connectAfterKill = {
    name: err.constructor.name,
    notFound: err instanceof NotFoundError || err instanceof SandboxNotFoundError,
    sandboxError: err instanceof SandboxError,
  }
}
process.stdout.write(JSON.stringify(seen) + '\n')

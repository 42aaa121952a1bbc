// Against the local stack (`./scripts/up`), from clients/typescript after `npm ci`:
//   node example.js <client-id> [--sandbox ID] [--session ID] [--tier TIER]
// e.g. `node example.js globex`: a health check, an Activate and a Place charged to that
// client, or the refusal's fields when a limit says no. It uses the stack's operator
// certificate under ../../.run/tls/ (relative to this file) unless TURNSTILE_TLS_CERT_FILE,
// TURNSTILE_TLS_KEY_FILE and TURNSTILE_TLS_CA_FILE say otherwise, and the stack's default
// addresses unless TURNSTILE_{ADMISSION,SUBSTRATE,AFFINITY}_ADDR do.
// Exit status: 0 when it ran (a refusal included), 1 when a call failed, 2 on bad usage.

import { existsSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import { Refused, TurnstileClient, TurnstileError } from "./src/client.js";

const USAGE =
  "usage: node example.js <client-id> [--sandbox ID] [--session ID] [--tier TIER]";

function usage(problem) {
  console.error(`example.js: ${problem}\n${USAGE}`);
  process.exit(2);
}

let parsed;
try {
  parsed = parseArgs({
    allowPositionals: true,
    options: {
      sandbox: { type: "string", default: "sb-example" },
      session: { type: "string", default: "chat-example" },
      tier: { type: "string", default: "container" },
      help: { type: "boolean", short: "h" },
    },
  });
} catch (error) {
  usage(error.message);
}
if (parsed.values.help) {
  console.log(USAGE);
  process.exit(0);
}
if (parsed.positionals.length !== 1) {
  usage("give one client id (the client the activation and the session are charged to)");
}
const [clientId] = parsed.positionals;
const { sandbox: sandboxId, session: sessionId, tier } = parsed.values;

const env = process.env;
const tlsFile = (name) => fileURLToPath(new URL(`../../.run/tls/${name}`, import.meta.url));
const tls = {
  cert: env.TURNSTILE_TLS_CERT_FILE ?? tlsFile("cli.crt"),
  key: env.TURNSTILE_TLS_KEY_FILE ?? tlsFile("cli.key"),
  ca: env.TURNSTILE_TLS_CA_FILE ?? tlsFile("ca.crt"),
};
for (const path of Object.values(tls)) {
  if (!existsSync(path)) {
    console.error(
      `example.js: no certificate file ${path}: start the local stack (./scripts/up in the ` +
        "checkout) or set TURNSTILE_TLS_CERT_FILE, TURNSTILE_TLS_KEY_FILE and TURNSTILE_TLS_CA_FILE",
    );
    process.exit(1);
  }
}

// A sandbox just activated serves sessions once its worker has attached to affinity
// (about a second): until then Place says the tier has no free slot. Ask again a few
// times, at most a second apart, before giving up.
async function placeOnceAttached(session, owner, placeTier, tries = 10) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await client.place(session, owner, { tier: placeTier });
    } catch (error) {
      if (!(error instanceof Refused) || error.reason !== "TIER_EXHAUSTED" || attempt === tries) {
        throw error;
      }
      await sleep(Math.min(error.retryAfterS, 1) * 1000);
    }
  }
}

const client = new TurnstileClient({
  admission: env.TURNSTILE_ADMISSION_ADDR ?? "127.0.0.1:50051",
  substrate: env.TURNSTILE_SUBSTRATE_ADDR ?? "127.0.0.1:50052",
  affinity: env.TURNSTILE_AFFINITY_ADDR ?? "127.0.0.1:50053",
  tls,
});

try {
  console.log("substrate:", await client.check("substrate"));
  const { sandbox, key } = await client.activate(sandboxId, clientId, { tier });
  console.log(`activated ${sandbox.sandbox_id} (${sandbox.runtime_name}), charged to ${key.key}`);
  const placed = await placeOnceAttached(sessionId, clientId, tier);
  console.log(`session ${sessionId} → ${placed.sandbox_id} (${placed.outcome})`);
} catch (error) {
  if (error instanceof Refused && error.reason === "TIER_EXHAUSTED") {
    console.log(`no free slot in tier ${tier} (TIER_EXHAUSTED); retry in ${error.retryAfterS} s`);
  } else if (error instanceof Refused) {
    console.log(
      `refused by ${error.policy} for key ${error.key}: ${error.current} of ${error.limit};` +
        ` retry in ${error.retryAfterS} s`,
    );
  } else if (error instanceof TurnstileError) {
    console.log(`failed: code ${error.code} ${error.reason}: ${error.message}`);
    process.exitCode = 1;
  } else {
    throw error;
  }
} finally {
  client.close();
}

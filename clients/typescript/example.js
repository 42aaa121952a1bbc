// Against the local stack (`./scripts/up`), from clients/typescript after `npm ci`:
//   node example.js
// It uses the stack's operator certificate under ../../.run/tls/ unless
// TURNSTILE_TLS_CERT_FILE, TURNSTILE_TLS_KEY_FILE and TURNSTILE_TLS_CA_FILE say otherwise,
// and the stack's default addresses unless TURNSTILE_{ADMISSION,SUBSTRATE,AFFINITY}_ADDR do.

import { join } from "node:path";

import { Refused, TurnstileClient, TurnstileError } from "./src/client.js";

const env = process.env;
const tlsDir = join(import.meta.dirname, "..", "..", ".run", "tls");
const client = new TurnstileClient({
  admission: env.TURNSTILE_ADMISSION_ADDR ?? "127.0.0.1:50051",
  substrate: env.TURNSTILE_SUBSTRATE_ADDR ?? "127.0.0.1:50052",
  affinity: env.TURNSTILE_AFFINITY_ADDR ?? "127.0.0.1:50053",
  tls: {
    cert: env.TURNSTILE_TLS_CERT_FILE ?? join(tlsDir, "cli.crt"),
    key: env.TURNSTILE_TLS_KEY_FILE ?? join(tlsDir, "cli.key"),
    ca: env.TURNSTILE_TLS_CA_FILE ?? join(tlsDir, "ca.crt"),
  },
});

try {
  console.log("substrate:", await client.check("substrate"));
  const { sandbox, key } = await client.activate("sb-example", "acme", { tier: "container" });
  console.log(`activated ${sandbox.sandbox_id} (${sandbox.runtime_name}), charged to ${key.key}`);
  const placed = await client.place("chat-example", "acme", { tier: "container" });
  console.log(`session chat-example → ${placed.sandbox_id} (${placed.outcome})`);
} catch (error) {
  if (error instanceof Refused) {
    console.log(
      `refused by ${error.policy} for key ${error.key}: ${error.current} of ${error.limit};` +
        ` retry in ${error.retryAfterS} s`,
    );
  } else if (error instanceof TurnstileError) {
    console.log(`failed: code ${error.code} ${error.reason}: ${error.message}`);
  } else {
    throw error;
  }
} finally {
  client.close();
}

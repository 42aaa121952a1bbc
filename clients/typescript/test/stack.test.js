// The Node client against a real local stack over mutual TLS. The stack is started
// by tests/clients/test_typescript_client.py (run by ./scripts/test), which gives
// its addresses and the CLI certificate in the environment and sets a limit of
// one activation (rate, burst 1) for the client id in TURNSTILE_TS_CLIENT_ID.

import assert from "node:assert/strict";
import { test } from "node:test";

import * as grpc from "@grpc/grpc-js";

import { Refused, TurnstileClient, TurnstileError } from "../src/client.js";

const env = process.env;
const skip = env.TURNSTILE_ADMISSION_ADDR
  ? false
  : "needs a running stack: run through tests/clients/test_typescript_client.py";
const tls = {
  cert: env.TURNSTILE_TLS_CERT_FILE,
  key: env.TURNSTILE_TLS_KEY_FILE,
  ca: env.TURNSTILE_TLS_CA_FILE,
};
const clientId = env.TURNSTILE_TS_CLIENT_ID;

function connect(options = {}) {
  return new TurnstileClient({
    admission: env.TURNSTILE_ADMISSION_ADDR,
    substrate: env.TURNSTILE_SUBSTRATE_ADDR,
    affinity: env.TURNSTILE_AFFINITY_ADDR,
    tls,
    deadlineS: 20,
    ...options,
  });
}

test("every service is SERVING over mTLS", { skip }, async () => {
  const client = connect();
  try {
    for (const service of ["admission", "substrate", "affinity"]) {
      assert.equal(await client.check(service), "SERVING");
    }
  } finally {
    client.close();
  }
});

test("a refused Admit and a refused Activate have one shape", { skip }, async () => {
  const client = connect();
  try {
    const activated = await client.activate("sb-ts-1", clientId, { tier: "container" });
    assert.equal(activated.sandbox.sandbox_id, "sb-ts-1");
    assert.equal(activated.key.key, clientId);

    const admitRefused = await client.admit("sb-ts-2", clientId, { tier: "container" }).then(
      () => assert.fail("admitted past the limit"),
      (error) => error,
    );
    const activateRefused = await client.activate("sb-ts-3", clientId, { tier: "container" }).then(
      () => assert.fail("activated past the limit"),
      (error) => error,
    );
    for (const refused of [admitRefused, activateRefused]) {
      assert.ok(refused instanceof Refused, String(refused));
      assert.equal(refused.code, grpc.status.RESOURCE_EXHAUSTED);
      assert.deepEqual(
        [refused.key, refused.policy, refused.reason],
        [clientId, "rate", "RATE_LIMITED"],
      );
      assert.equal(typeof refused.limit, "number");
      assert.equal(typeof refused.current, "number");
      assert.ok(refused.retryAfterS > 0, `retryAfterS ${refused.retryAfterS}`);
    }
    // Only the error carries the rich details a server sends.
    assert.equal(activateRefused.quotaViolations[0].subject, clientId);
    assert.equal(activateRefused.domain, "turnstile.dev");
  } finally {
    client.close();
  }
});

test("a server whose certificate names another identity is not talked to", { skip }, async () => {
  const wrong = { admission: "spiffe://turnstile.local/service/substrate" };
  const client = connect({ serverIds: wrong, deadlineS: 3 });
  try {
    const error = await client.admit("sb-ts-4", clientId).then(
      () => assert.fail("talked to a server with the wrong identity"),
      (e) => e,
    );
    assert.ok(error instanceof TurnstileError && !(error instanceof Refused), String(error));
    assert.ok(
      [grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED].includes(error.code),
      String(error),
    );
  } finally {
    client.close();
  }
});

// Type-checked (tsc --noEmit, run by test/types.test.js), never run: TypeScript code
// using the client through src/client.d.ts.

import { Refused, TurnstileClient, TurnstileError } from "../src/client.js";

export async function activateOrExplain(sandboxId: string): Promise<string> {
  const client = new TurnstileClient({
    substrate: "127.0.0.1:50052",
    tls: { cert: "cli.crt", key: "cli.key", ca: "ca.crt" },
    deadlineS: 5,
  });
  try {
    const response = await client.activate(sandboxId, "acme", { tier: "container" });
    return String(response.sandbox.runtime_name);
  } catch (error) {
    if (error instanceof Refused) {
      const retry: number | null = error.retryAfterS;
      return `${error.policy} ${error.key} ${error.current}/${error.limit} ${retry}`;
    }
    if (error instanceof TurnstileError) return `${error.code} ${error.reason}`;
    throw error;
  } finally {
    client.close();
  }
}

// A gateway's Prepare when the user starts typing (SPEC W2): not awaited before the turn.
export function prepareOnTyping(client: TurnstileClient, sessionId: string): Promise<string> {
  return client.prepare(sessionId, "acme", { deadlineS: 2 }).then((r) => String(r.outcome));
}

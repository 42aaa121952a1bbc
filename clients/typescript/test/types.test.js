// src/client.d.ts describes the module: TypeScript code using it type-checks.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");

test("TypeScript code using the client type-checks", () => {
  const tsc = join(root, "node_modules", ".bin", "tsc");
  const out = execFileSync(tsc, ["--project", join(root, "tsconfig.json")], { encoding: "utf8" });
  assert.equal(out, "");
});

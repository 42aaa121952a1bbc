// A small Node.js client for Turnstile (docs/clients.md): loads the contracts,
// sets up mutual TLS with the server identity check, decodes rich errors, retries
// what the server says is retryable, and gives refusals one shape.
//
// Types: src/client.d.ts describes this module's API; the request and response
// messages are plain objects shaped as the .proto files say (proto-loader with
// `longs: Number, enums: String, defaults: true`). `npm run gen-types` generates
// TypeScript types for every message with proto-loader-gen-types.

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";

const here = dirname(fileURLToPath(import.meta.url));

/** Where the protos are: the repository's own, then the third-party ones shipped here. */
export const PROTO_DIRS = [
  process.env.TURNSTILE_PROTO_DIR ?? join(here, "..", "..", "..", "proto"),
  join(here, "..", "proto", "third_party"),
];

const PROTO_FILES = [
  "turnstile/admission/v1/admission.proto",
  "turnstile/substrate/v1/substrate.proto",
  "turnstile/affinity/v1/affinity.proto",
  "grpc/health/v1/health.proto",
];

/** The ErrorInfo.domain of every Turnstile error. */
export const ERROR_DOMAIN = "turnstile.dev";

/** The trust domain of the local stack's PKI (`./scripts/up`). */
export const DEFAULT_TRUST_DOMAIN = "turnstile.local";

let loaded;

/** The gRPC package definitions and the protobufjs root for google.rpc (loaded once). */
export function contracts() {
  if (loaded === undefined) {
    const definition = protoLoader.loadSync(PROTO_FILES, {
      includeDirs: PROTO_DIRS,
      keepCase: true,
      longs: Number,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    const root = new protobuf.Root();
    // protobufjs resolves imports against the including file; point it at our dirs.
    root.resolvePath = (_origin, target) => {
      for (const dir of PROTO_DIRS) {
        const path = join(dir, target);
        try {
          readFileSync(path);
          return path;
        } catch {
          // not in this directory
        }
      }
      return target; // google/protobuf/*: protobufjs's bundled copies
    };
    root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
    loaded = { grpc: grpc.loadPackageDefinition(definition), root };
  }
  return loaded;
}

/** The DNS name a Turnstile server holding `spiffeId` carries beside it: the path
 * segments reversed, then the trust domain (`spiffe://turnstile.local/service/admission`
 * → `admission.service.turnstile.local`). */
export function serverName(spiffeId) {
  const match = /^spiffe:\/\/([^/]+)\/(.+)$/.exec(spiffeId);
  if (!match) throw new Error(`${spiffeId} is not a SPIFFE ID with a path`);
  return [...match[2].split("/").reverse(), match[1]].join(".");
}

/** A failed call, with the rich details the server sent (google.rpc.Status). */
export class TurnstileError extends Error {
  constructor(fields) {
    super(fields.message);
    this.name = "TurnstileError";
    Object.assign(this, {
      reason: "",
      domain: "",
      metadata: {},
      retryAfterS: null,
      quotaViolations: [],
      fieldViolations: [],
      ...fields,
    });
  }

  get retryable() {
    return this.retryAfterS !== null;
  }
}

/** A limit said no: a refused Admit (an OK response) or a refused Activate
 * (RESOURCE_EXHAUSTED) alike. */
export class Refused extends TurnstileError {
  constructor(fields) {
    super({ key: "", policy: "", limit: null, current: null, ...fields });
    this.name = "Refused";
  }
}

const POLICY_REASONS = {
  POLICY_CAP: "CAP_EXCEEDED",
  POLICY_RATE: "RATE_LIMITED",
  POLICY_CONCURRENCY: "CONCURRENCY_LIMITED",
  POLICY_NODE_SLOTS: "NODE_SLOTS_EXHAUSTED",
};

function seconds(duration) {
  if (!duration) return null;
  return Number(duration.seconds ?? 0) + Number(duration.nanos ?? 0) / 1e9;
}

/** Decode a grpc-js error: the google.rpc.Status in `grpc-status-details-bin`
 * (ErrorInfo, RetryInfo, QuotaFailure, BadRequest). A limit refusal decodes as
 * Refused. An error without details keeps its code and message. */
export function decode(error) {
  const { root } = contracts();
  const fields = { code: error.code, message: error.details ?? error.message };
  const raw = error.metadata?.get?.("grpc-status-details-bin")?.[0];
  if (raw) {
    const status = root.lookupType("google.rpc.Status").decode(raw);
    for (const any of status.details) {
      const url = any.type_url ?? any.typeUrl; // protobufjs bundles Any with its snake_case names
      const typeName = url.slice(url.lastIndexOf("/") + 1);
      const detail = root.lookupType(typeName).decode(any.value);
      if (typeName === "google.rpc.ErrorInfo") {
        fields.reason = detail.reason;
        fields.domain = detail.domain;
        fields.metadata = { ...detail.metadata };
      } else if (typeName === "google.rpc.RetryInfo") {
        fields.retryAfterS = seconds(detail.retryDelay) ?? 0;
      } else if (typeName === "google.rpc.QuotaFailure") {
        fields.quotaViolations = detail.violations.map((v) => ({
          subject: v.subject,
          description: v.description,
        }));
      } else if (typeName === "google.rpc.BadRequest") {
        fields.fieldViolations = detail.fieldViolations.map((v) => ({
          subject: v.field,
          description: v.description,
        }));
      }
    }
  }
  if (fields.code === grpc.status.RESOURCE_EXHAUSTED && fields.domain === ERROR_DOMAIN) {
    const m = fields.metadata;
    return new Refused({
      ...fields,
      key: m.key ?? "",
      policy: m.policy ?? "",
      limit: m.limit !== undefined ? Number(m.limit) : null,
      current: m.current !== undefined ? Number(m.current) : null,
    });
  }
  return new TurnstileError(fields);
}

function refusedAdmit(response) {
  const policy = response.refused_by.replace(/^POLICY_/, "").toLowerCase();
  return new Refused({
    code: grpc.status.RESOURCE_EXHAUSTED,
    message: response.message || `refused by the ${policy} policy`,
    reason: POLICY_REASONS[response.refused_by] ?? "UNSPECIFIED",
    domain: ERROR_DOMAIN,
    metadata: { key: response.key?.key ?? "", policy },
    retryAfterS: seconds(response.retry_after),
    key: response.key?.key ?? "",
    policy,
    limit: response.limit,
    current: response.current,
  });
}

/** Channel credentials for mutual TLS from PEM files. */
export function mtls({ cert, key, ca }) {
  return grpc.credentials.createSsl(readFileSync(ca), readFileSync(key), readFileSync(cert));
}

export class TurnstileClient {
  /**
   * @param {object} options
   * @param {string} [options.admission] host:port of each service you call
   * @param {string} [options.substrate]
   * @param {string} [options.affinity]
   * @param {{cert: string, key: string, ca: string} | null} options.tls PEM file paths; null: plaintext (loopback development only)
   * @param {string} [options.trustDomain] the services' trust domain (turnstile.local)
   * @param {Record<string, string>} [options.serverIds] the SPIFFE ID expected of a service, by name
   * @param {number} [options.deadlineS] each call's deadline (10 s)
   * @param {{attempts: number, maxDelayS: number}} [options.retry] UNAVAILABLE-with-RetryInfo retries
   */
  constructor({
    admission,
    substrate,
    affinity,
    tls,
    trustDomain = DEFAULT_TRUST_DOMAIN,
    serverIds = {},
    deadlineS = 10,
    retry = { attempts: 3, maxDelayS: 2 },
  }) {
    const pkg = contracts().grpc;
    const credentials = tls ? mtls(tls) : grpc.credentials.createInsecure();
    const open = (name, Service, target) => {
      if (!target) return null;
      const id = serverIds[name] ?? `spiffe://${trustDomain}/service/${name}`;
      const options = tls ? { "grpc.ssl_target_name_override": serverName(id) } : {};
      return new Service(target, credentials, options);
    };
    this.stubs = {
      admission: open("admission", pkg.turnstile.admission.v1.AdmissionService, admission),
      substrate: open("substrate", pkg.turnstile.substrate.v1.SubstrateService, substrate),
      affinity: open("affinity", pkg.turnstile.affinity.v1.AffinityService, affinity),
    };
    this.health = Object.fromEntries(
      Object.entries({ admission, substrate, affinity })
        .filter(([, target]) => target)
        .map(([name, target]) => [name, open(name, pkg.grpc.health.v1.Health, target)]),
    );
    this.deadlineS = deadlineS;
    this.retry = retry;
  }

  close() {
    for (const stub of [...Object.values(this.stubs), ...Object.values(this.health)]) {
      stub?.close();
    }
  }

  /** The health of one service (`SERVING`, `NOT_SERVING` …). */
  async check(service, { deadlineS } = {}) {
    const full = {
      admission: "turnstile.admission.v1.AdmissionService",
      substrate: "turnstile.substrate.v1.SubstrateService",
      affinity: "turnstile.affinity.v1.AffinityService",
    }[service];
    const response = await this.#call(this.health[service], "Check", { service: full }, deadlineS);
    return response.status;
  }

  /** Admit an activation; throws Refused when a limit refused it (an OK response). */
  async admit(sandboxId, clientId, { tier = "", deadlineS } = {}) {
    const request = {
      sandbox_id: sandboxId,
      client: { client_id: clientId },
      kind: "ACTIVATION_KIND_COLD_CREATE",
      tier,
    };
    const response = await this.#call(this.stubs.admission, "Admit", request, deadlineS);
    if (response.decision === "DECISION_REFUSED") throw refusedAdmit(response);
    return response;
  }

  /** Make the sandbox's runtime exist; throws Refused when a limit refused it. */
  async activate(sandboxId, clientId, { tier = "", deadlineS } = {}) {
    const request = { sandbox_id: sandboxId, client: { client_id: clientId }, tier };
    return this.#call(this.stubs.substrate, "Activate", request, deadlineS);
  }

  /** Place a session on a worker (the one it had, when it can). */
  async place(sessionId, clientId, { tier = "", deadlineS } = {}) {
    const request = { session_id: sessionId, tier, client_id: clientId };
    return this.#call(this.stubs.affinity, "Place", request, deadlineS);
  }

  /** Say the session is about to take a turn (the user opened it or started typing): its
   * sandbox's wake starts now if it is away (SPEC W2). Resolves at once with `outcome`. */
  async prepare(sessionId, clientId, { deadlineS } = {}) {
    const request = { session_id: sessionId, client_id: clientId };
    return this.#call(this.stubs.affinity, "Prepare", request, deadlineS);
  }

  async #call(stub, method, request, deadlineS) {
    if (!stub) throw new Error(`this client has no address for ${method}'s service`);
    const deadline = Date.now() + 1000 * (deadlineS ?? this.deadlineS);
    for (let attempt = 1; ; attempt++) {
      try {
        return await new Promise((resolve, reject) => {
          stub[method](request, { deadline: new Date(deadline) }, (error, response) =>
            error ? reject(error) : resolve(response),
          );
        });
      } catch (raw) {
        const error = decode(raw);
        const wait = Math.min(error.retryAfterS ?? 0, this.retry.maxDelayS);
        const retry =
          error.code === grpc.status.UNAVAILABLE &&
          error.retryAfterS !== null &&
          attempt < this.retry.attempts &&
          Date.now() + 1000 * wait < deadline;
        if (!retry) throw error;
        await sleep(1000 * wait);
      }
    }
  }
}

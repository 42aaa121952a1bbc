// Types of src/client.js. Request and response messages are plain objects shaped as
// the .proto files say; `npm run gen-types` writes a type for every one of them into
// types/ (proto-loader-gen-types, with the options contracts() loads with).

import type * as grpc from "@grpc/grpc-js";

export const PROTO_DIRS: string[];
export const ERROR_DOMAIN: "turnstile.dev";
export const DEFAULT_TRUST_DOMAIN: "turnstile.local";

export function contracts(): { grpc: grpc.GrpcObject; root: import("protobufjs").Root };
export function serverName(spiffeId: string): string;
export function mtls(files: TlsFiles): grpc.ChannelCredentials;
export function decode(error: grpc.ServiceError): TurnstileError;

export interface TlsFiles {
  cert: string;
  key: string;
  ca: string;
}

export interface Violation {
  subject: string;
  description: string;
}

export class TurnstileError extends Error {
  code: grpc.status;
  reason: string;
  domain: string;
  metadata: Record<string, string>;
  retryAfterS: number | null;
  quotaViolations: Violation[];
  fieldViolations: Violation[];
  readonly retryable: boolean;
}

export class Refused extends TurnstileError {
  key: string;
  policy: string;
  limit: number | null;
  current: number | null;
}

export type ServiceName = "admission" | "substrate" | "affinity";

export interface ClientOptions {
  admission?: string;
  substrate?: string;
  affinity?: string;
  tls: TlsFiles | null;
  trustDomain?: string;
  serverIds?: Partial<Record<ServiceName, string>>;
  deadlineS?: number;
  retry?: { attempts: number; maxDelayS: number };
}

export interface CallOptions {
  tier?: string;
  deadlineS?: number;
}

// Responses as contracts() decodes them (keepCase, enums as strings, longs as numbers).
export type Message = Record<string, any>;

export class TurnstileClient {
  constructor(options: ClientOptions);
  deadlineS: number;
  retry: { attempts: number; maxDelayS: number };
  close(): void;
  check(service: ServiceName, options?: { deadlineS?: number }): Promise<string>;
  admit(sandboxId: string, clientId: string, options?: CallOptions): Promise<Message>;
  activate(sandboxId: string, clientId: string, options?: CallOptions): Promise<Message>;
  place(sessionId: string, clientId: string, options?: CallOptions): Promise<Message>;
  prepare(sessionId: string, clientId: string, options?: { deadlineS?: number }): Promise<Message>;
}

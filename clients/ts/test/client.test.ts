/**
 * The TypeScript client against a live server with the demo corpus and API keys on;
 * pytest starts it (tests/e2e/clients/test_ts_client.py) and passes RETRIEVAL_TARGET,
 * RETRIEVAL_API_KEY (a principal in the "support" group) and RETRIEVAL_PUBLIC_API_KEY.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer, connect, type AddressInfo, type Server } from "node:net";
import { after, before, describe, test } from "node:test";

import { type Interceptor, InterceptingCall, Metadata, status } from "@grpc/grpc-js";

import { RetryInfo } from "../src/gen/google/rpc/error_details";
import { Status as RpcStatus } from "../src/gen/google/rpc/status";

import {
  BackendTimeoutError,
  BudgetExhaustedError,
  CancelledError,
  type Event,
  fromServiceError,
  InvalidArgumentError,
  NotFoundError,
  OverloadedError,
  RetrievalClient,
  RetrievalError,
  UnauthenticatedError,
  UnavailableError,
} from "../src";

const target = process.env.RETRIEVAL_TARGET ?? "";
const supportKey = process.env.RETRIEVAL_API_KEY ?? "";
const publicKey = process.env.RETRIEVAL_PUBLIC_API_KEY ?? "";
if (!target) {
  console.error("RETRIEVAL_TARGET is not set: run through tests/e2e/clients/test_ts_client.py");
  process.exit(1);
}

describe("RetrievalClient against a live server", () => {
  let client: RetrievalClient;
  before(() => {
    client = new RetrievalClient(target, { apiKey: supportKey });
  });
  after(() => client.close());

  test("retrieve returns a typed attempt", async () => {
    const attempt = await client.retrieve("how do I reset my password", { topK: 2 });
    assert.equal(attempt.outcome.name, "EVIDENCE_FOUND");
    assert.equal(attempt.outcome.isInfrastructureFailure(), false);
    assert.deepEqual(
      attempt.evidence.map((e) => e.rank),
      [1, 2],
    );
    assert.equal(attempt.evidence[0]?.sourceId, "kb-password-reset");
    assert.deepEqual(attempt.legs.map((l) => l.kind).sort(), ["BM25", "KNN", "KNN_LATIN", "RERANK"]);
    const record = await client.getAttempt(attempt.attemptId);
    assert.equal(record?.query, "how do I reset my password");
    assert.equal(record?.principal, "support-bot");

    const empty = await client.retrieve("password", { sourceIds: ["nope"] });
    assert.equal(empty.outcome.name, "EMPTY");
    assert.equal(empty.outcome.isInfrastructureFailure(), false);
    assert.deepEqual(empty.evidence, []);
  });

  test("events: legs, then evidence, then exactly one result; leaving early cancels", async () => {
    const kinds: Event["kind"][] = [];
    for await (const event of client.events("cancel my subscription", { topK: 3 })) kinds.push(event.kind);
    assert.deepEqual(kinds, ["leg", "leg", "leg", "evidence", "evidence", "evidence", "result"]);
    for await (const event of client.events("how do I reset my password")) {
      assert.equal(event.kind, "leg");
      break;
    }
    assert.equal((await client.retrieve("how do I reset my password", { topK: 1 })).outcome.name, "EVIDENCE_FOUND");
  });

  test("an AbortSignal ends the stream with CancelledError", async () => {
    const controller = new AbortController();
    let seen = 0;
    await assert.rejects(async () => {
      for await (const _ of client.events("cancel my subscription", { topK: 5, signal: controller.signal })) {
        seen++;
        controller.abort();
      }
    }, CancelledError);
    assert.equal(seen, 1);
  });

  test("errors are typed and carry their google.rpc details", async () => {
    const bad = await client.retrieve("", { topK: 999, collections: ["wiki"] }).catch((e: unknown) => e);
    assert.ok(bad instanceof InvalidArgumentError, String(bad));
    assert.equal(bad.codeName, "INVALID_ARGUMENT");
    assert.deepEqual([...bad.fields].sort(), ["filters.collections[0]", "query", "top_k"]);
    await assert.rejects(client.getAttempt("missing"), NotFoundError);
    const stranger = new RetrievalClient(target, { apiKey: "wrong" });
    await assert.rejects(stranger.retrieve("how do I reset my password"), UnauthenticatedError);
    stranger.close();

    const runId = `ts-test-budget-${Date.now()}`;
    const inRun = { topK: 1, runId, budget: { maxSearches: 1 } };
    assert.equal((await client.retrieve("how do I reset my password", inRun)).outcome.name, "EVIDENCE_FOUND");
    assert.equal((await client.retrieve("how do I reset my password", inRun)).outcome.name, "BUDGET_DENIED");
    const denied = await client.lookup("how do I reset my password", inRun).catch((e: unknown) => e);
    assert.ok(denied instanceof BudgetExhaustedError, String(denied));
    assert.notEqual(denied.attemptId, "");
  });

  test("ACL groups come from the API key", async () => {
    const query = "orion-pager escalation";
    const support = await client.retrieve(query, { topK: 3 });
    assert.equal(support.evidence[0]?.sourceId, "internal-escalation");
    const outsider = new RetrievalClient(target, { apiKey: publicKey });
    const pub = await outsider.retrieve(query, { topK: 3 });
    outsider.close();
    assert.ok(pub.evidence.every((e) => e.sourceId !== "internal-escalation"));
  });

  test("lookup is the tool-result JSON", async () => {
    const found = await client.lookup("如何开具发票", { topK: 1, toolCallId: "t1" });
    assert.equal(found.evidence_status, "EVIDENCE_FOUND");
    assert.equal(found.tool_call_id, "t1");
    assert.equal(found.evidence[0]?.source, "faq-invoice-zh");
    const none = await client.lookup("zebra", { topK: 1, minQuality: 0.99 });
    const json = JSON.parse(JSON.stringify(none)) as Record<string, unknown>;
    assert.equal(json.evidence_status, "NO_EVIDENCE");
    assert.deepEqual(json.evidence, []);
    assert.ok(!("relevance_level" in json));
  });

  test("every call has a deadline: the default when the caller sets none", async () => {
    const hasty = new RetrievalClient(target, { apiKey: supportKey, timeoutMs: 0 });
    await assert.rejects(hasty.retrieve("how do I reset my password"), BackendTimeoutError);
    // The caller's own deadline wins over the default.
    assert.equal((await hasty.retrieve("how do I reset my password", { topK: 1, timeoutMs: 10_000 })).outcome.name, "EVIDENCE_FOUND");
    hasty.close();
  });
});

describe("error details", () => {
  // The overload path needs a saturated server (tests/fault covers the server side); here
  // the status the server builds for it (RetryInfo in grpc-status-details-bin) is decoded
  // the way a live call's would be.
  test("RESOURCE_EXHAUSTED becomes OverloadedError with the RetryInfo delay", () => {
    const detail = RetryInfo.encode({ retryDelay: { seconds: 0, nanos: 250_000_000 } }).finish();
    const metadata = new Metadata();
    metadata.set(
      "grpc-status-details-bin",
      Buffer.from(
        RpcStatus.encode({
          code: status.RESOURCE_EXHAUSTED,
          message: "too many attempts in flight",
          details: [{ typeUrl: "type.googleapis.com/google.rpc.RetryInfo", value: Buffer.from(detail) }],
        }).finish(),
      ),
    );
    metadata.set("x-attempt-id", "a-1");
    const err = fromServiceError(
      Object.assign(new Error("8 RESOURCE_EXHAUSTED"), {
        code: status.RESOURCE_EXHAUSTED,
        details: "too many attempts in flight",
        metadata,
      }),
    );
    assert.ok(err instanceof OverloadedError);
    assert.equal(err.retryAfterMs, 250);
    assert.equal(err.attemptId, "a-1");
    assert.equal(err.codeName, "RESOURCE_EXHAUSTED");
  });
});

describe("TLS", () => {
  test("tls.rootCerts trusts the server's certificate; the system roots and plaintext do not", async () => {
    const tlsTarget = process.env.RETRIEVAL_TLS_TARGET ?? "";
    const ca = process.env.RETRIEVAL_TLS_CA ?? "";
    assert.ok(tlsTarget && ca, "RETRIEVAL_TLS_TARGET / RETRIEVAL_TLS_CA set by the harness");
    const secure = new RetrievalClient(tlsTarget, { apiKey: supportKey, tls: { rootCerts: readFileSync(ca) } });
    assert.equal((await secure.retrieve("how do I reset my password", { topK: 1 })).outcome.name, "EVIDENCE_FOUND");
    secure.close();
    for (const tls of [true, false]) {
      const client = new RetrievalClient(tlsTarget, { apiKey: supportKey, tls, timeoutMs: 2000 });
      const err = await client.getAttempt("x").catch((e: unknown) => e);
      client.close();
      assert.ok(err instanceof RetrievalError && !(err instanceof NotFoundError), `tls=${tls}: ${String(err)}`);
    }
  });
});

describe("retries", () => {
  const freePort = async (): Promise<number> =>
    new Promise((resolve) => {
      const s = createServer();
      s.listen(0, "127.0.0.1", () => {
        const { port } = s.address() as AddressInfo;
        s.close(() => resolve(port));
      });
    });
  // Reconnect quickly, so a retry after a short wait really dials again.
  const fast = { "grpc.initial_reconnect_backoff_ms": 10, "grpc.max_reconnect_backoff_ms": 50 };
  let tries = 0;
  const counting: Interceptor = (options, nextCall) => {
    tries++;
    return new InterceptingCall(nextCall(options));
  };

  test("only idempotent unary calls retry UNAVAILABLE", async () => {
    const down = `127.0.0.1:${await freePort()}`;
    const client = new RetrievalClient(down, {
      apiKey: supportKey,
      maxAttempts: 3,
      retryBackoffMs: 20,
      grpcOptions: { ...fast, interceptors: [counting] },
    });
    tries = 0;
    await assert.rejects(client.getAttempt("x"), UnavailableError);
    assert.equal(tries, 3, "GetAttempt is tried 3 times");
    tries = 0;
    await assert.rejects(client.lookup("how do I reset my password"), UnavailableError);
    assert.equal(tries, 3, "Lookup without a run is tried 3 times");
    tries = 0;
    await assert.rejects(client.lookup("how do I reset my password", { runId: "r" }), UnavailableError);
    assert.equal(tries, 1, "Lookup in a run spends budget per try: never retried");
    tries = 0;
    await assert.rejects(client.retrieve("how do I reset my password"), UnavailableError);
    assert.equal(tries, 1, "Retrieve is a stream: never retried");
    client.close();
  });

  test("a server that comes back between tries answers the retried call", async () => {
    const port = await freePort();
    const client = new RetrievalClient(`127.0.0.1:${port}`, {
      apiKey: supportKey,
      maxAttempts: 6,
      retryBackoffMs: 100,
      grpcOptions: { ...fast, interceptors: [counting] },
    });
    tries = 0;
    const [host, upstream] = [target.slice(0, target.lastIndexOf(":")), Number(target.slice(target.lastIndexOf(":") + 1))];
    let proxy: Server | undefined;
    const sockets: { destroy(): void }[] = [];
    const timer = setTimeout(() => {
      proxy = createServer((socket) => {
        const out = connect(upstream, host);
        sockets.push(socket, out);
        socket.pipe(out).pipe(socket);
        socket.on("error", () => out.destroy());
        out.on("error", () => socket.destroy());
      }).listen(port, "127.0.0.1");
    }, 150);
    try {
      const tool = await client.lookup("how do I reset my password", { topK: 1 });
      assert.equal(tool.evidence_status, "EVIDENCE_FOUND");
      assert.ok(tries >= 2, `answered on try ${tries}`);
    } finally {
      clearTimeout(timer);
      client.close();
      proxy?.close();
      for (const s of sockets) s.destroy();
    }
  });
});

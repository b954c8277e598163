/**
 * Runs the shared golden scenarios (tests/e2e/clients/golden_scenarios.json) through the
 * TypeScript client and prints the transcript as JSON; tests/e2e/clients/test_golden.py
 * compares it with the Python and Go clients' transcripts.
 *
 *   node dist/test/golden.js --target 127.0.0.1:50051 --scenarios golden_scenarios.json
 */

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { type Attempt, codeName, RetrievalClient, RetrievalError, type RetrieveOptions } from "../src";

interface RawRequest {
  query: string;
  top_k?: number;
  run_id?: string;
  budget?: { max_searches: number };
  collections?: string[];
  source_ids?: string[];
  metadata?: Record<string, string>;
  legs?: string[];
  min_quality?: number;
  tool_call_id?: string;
}

interface Step {
  call: "retrieve" | "lookup" | "cancel_after_first_event";
  as?: string;
  request: RawRequest;
}

interface ScenarioFile {
  api_keys: Record<string, string>;
  scenarios: { name: string; steps: Step[] }[];
}

function options(r: RawRequest, clientName: string): RetrieveOptions {
  const o: RetrieveOptions = { topK: r.top_k ?? 10 };
  if (r.run_id) o.runId = `${r.run_id}-${clientName}`;
  if (r.budget) o.budget = { maxSearches: r.budget.max_searches };
  if (r.collections) o.collections = r.collections;
  if (r.source_ids) o.sourceIds = r.source_ids;
  if (r.metadata) o.metadata = r.metadata;
  if (r.legs) o.legs = r.legs;
  if (r.min_quality) o.minQuality = r.min_quality;
  if (r.tool_call_id) o.toolCallId = r.tool_call_id;
  return o;
}

function attemptOf(a: Attempt): object {
  return {
    outcome: a.outcome.name,
    infrastructure_failure: a.outcome.isInfrastructureFailure(),
    relevance_level: a.relevanceLevel ?? "",
    stopping_reason: a.stoppingReason,
    degraded: a.degraded,
    legs: Object.fromEntries(a.legs.map((l) => [l.kind, l.status])),
    evidence: a.evidence.map((e) => ({ rank: e.rank, evidence_id: e.evidenceId, quality: e.quality })),
  };
}

function errorOf(err: unknown): object {
  if (!(err instanceof RetrievalError)) throw err;
  const fields = "fields" in err ? [...(err.fields as string[])].sort() : [];
  return { code: codeName(err.code), fields, attempt_recorded: err.attemptId !== "" };
}

async function run(client: RetrievalClient, step: Step, clientName: string): Promise<object> {
  const o = options(step.request, clientName);
  try {
    switch (step.call) {
      case "retrieve":
        return attemptOf(await client.retrieve(step.request.query, o));
      case "lookup":
        return { tool_result: await client.lookup(step.request.query, o) };
      case "cancel_after_first_event": {
        const controller = new AbortController();
        const seen: string[] = [];
        try {
          for await (const event of client.events(step.request.query, { ...o, signal: controller.signal })) {
            seen.push(event.kind);
            controller.abort(); // the caller goes away after the first event
          }
        } catch (err) {
          return { events_before_cancel: seen, error: errorOf(err) };
        }
        return { events_before_cancel: seen, error: null };
      }
    }
  } catch (err) {
    return { error: errorOf(err) };
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: { target: { type: "string" }, scenarios: { type: "string" }, client: { type: "string", default: "typescript" } },
  });
  const file = JSON.parse(readFileSync(values.scenarios ?? "", "utf8")) as ScenarioFile;
  const clients = new Map<string, RetrievalClient>();
  const scenarios: object[] = [];
  for (const scenario of file.scenarios) {
    const steps: object[] = [];
    for (const step of scenario.steps) {
      const principal = step.as ?? "public";
      let client = clients.get(principal);
      if (!client) {
        client = new RetrievalClient(values.target ?? "", { apiKey: file.api_keys[principal] ?? "" });
        clients.set(principal, client);
      }
      steps.push(await run(client, step, values.client ?? "typescript"));
    }
    scenarios.push({ name: scenario.name, steps });
  }
  for (const c of clients.values()) c.close();
  process.stdout.write(JSON.stringify({ client: "typescript", scenarios }) + "\n");
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

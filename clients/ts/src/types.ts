/** Typed, plain-TypeScript views of the service's messages. */

import {
  AttemptResult,
  EvidenceItem,
  LegReport,
  LookupResult,
  RetrieveEvent,
} from "./gen/retrieval/v1/retrieval";
import {
  attemptOutcomeToJSON,
  evidenceStatusToJSON,
  legKindToJSON,
  legStatusToJSON,
  RelevanceLevel,
  relevanceLevelToJSON,
} from "./gen/retrieval/v1/types";

/** The typed result of one attempt (AttemptOutcome without its prefix). */
export type OutcomeName =
  | "EVIDENCE_FOUND"
  | "EMPTY"
  | "INSUFFICIENT"
  | "INADMISSIBLE"
  | "TIMEOUT"
  | "BACKEND_ERROR"
  | "BUDGET_DENIED"
  | "PERMISSION_DENIED"
  | "CANCELLED"
  | "UNSPECIFIED";

export class Outcome {
  constructor(readonly name: OutcomeName) {}

  /** True when the backend, not the knowledge base, is why there is no evidence
   * (TIMEOUT, BACKEND_ERROR): never read it as "nothing exists". */
  isInfrastructureFailure(): boolean {
    return this.name === "TIMEOUT" || this.name === "BACKEND_ERROR";
  }

  toString(): string {
    return this.name;
  }

  toJSON(): string {
    return this.name;
  }
}

const strip = (value: string, prefix: string): string =>
  value.startsWith(prefix) ? value.slice(prefix.length) : value;

/** How one leg (BM25, KNN, RERANK) went. */
export interface Leg {
  kind: string; // "BM25" | "KNN" | "RERANK"
  status: string; // "OK" | "TIMEOUT" | "ERROR" | "SKIPPED"
  latencyMs: number;
  hitCount: number;
  detail: string;
}

export function legOf(m: LegReport): Leg {
  return {
    kind: strip(legKindToJSON(m.kind), "LEG_KIND_"),
    status: strip(legStatusToJSON(m.status), "LEG_STATUS_"),
    latencyMs: m.latencyMs,
    hitCount: m.hitCount,
    detail: m.detail,
  };
}

/** One returned item; evidenceId (`source#chunk@version`) is what a run cites. */
export interface Evidence {
  evidenceId: string;
  sourceId: string;
  version: string;
  title: string;
  breadcrumb: string;
  excerpt: string;
  context: string;
  rank: number;
  quality: number;
  fusedScore: number;
  bm25Score?: number; // absent when the lexical leg did not find it
  denseScore?: number; // absent when the vector leg did not find it
  rerankScore?: number; // absent when it was not reranked
  metadata: Record<string, string>;
}

export function evidenceOf(m: EvidenceItem): Evidence {
  return {
    evidenceId: m.evidenceId,
    sourceId: m.sourceId,
    version: m.version,
    title: m.title,
    breadcrumb: m.breadcrumb,
    excerpt: m.excerpt,
    context: m.context,
    rank: m.rank,
    quality: m.quality,
    fusedScore: m.fusedScore,
    ...(m.bm25Score !== undefined ? { bm25Score: m.bm25Score } : {}),
    ...(m.denseScore !== undefined ? { denseScore: m.denseScore } : {}),
    ...(m.rerankScore !== undefined ? { rerankScore: m.rerankScore } : {}),
    metadata: { ...m.metadata },
  };
}

/** The closing AttemptResult of a Retrieve stream, with the evidence before it. */
export interface Attempt {
  attemptId: string;
  outcome: Outcome;
  /** "PRECISE" | "HIGHLY_RELEVANT" | "REFERENCE", or null when the call reached none. */
  relevanceLevel: string | null;
  degraded: boolean;
  truncated: boolean;
  stoppingReason: string;
  legs: Leg[];
  evidence: Evidence[];
  /** The AttemptResult as received, for the fields not copied above. */
  raw: AttemptResult;
}

export function attemptOf(m: AttemptResult, evidence: Evidence[]): Attempt {
  return {
    attemptId: m.attemptId,
    outcome: new Outcome(strip(attemptOutcomeToJSON(m.outcome), "ATTEMPT_OUTCOME_") as OutcomeName),
    relevanceLevel:
      m.relevanceLevel === RelevanceLevel.RELEVANCE_LEVEL_UNSPECIFIED
        ? null
        : strip(relevanceLevelToJSON(m.relevanceLevel), "RELEVANCE_LEVEL_"),
    degraded: m.degraded,
    truncated: m.truncated,
    stoppingReason: m.stoppingReason,
    legs: m.legs.map(legOf),
    evidence,
    raw: m,
  };
}

/** One element of the Retrieve stream. */
export type Event =
  | { kind: "leg"; leg: Leg }
  | { kind: "evidence"; evidence: Evidence }
  /** Always last, exactly once; its evidence list is empty (the events before carried it). */
  | { kind: "result"; result: Attempt };

export function eventOf(m: RetrieveEvent): Event {
  const e = m.event;
  switch (e?.$case) {
    case "leg":
      return { kind: "leg", leg: legOf(e.value) };
    case "evidence":
      return { kind: "evidence", evidence: evidenceOf(e.value) };
    case "result":
      return { kind: "result", result: attemptOf(e.value, []) };
    default:
      throw new Error("RetrieveEvent without an event");
  }
}

/** Lookup's agent projection, ready to hand to an LLM as a tool result
 * (JSON.stringify it): snake_case names, enum values without their prefixes,
 * relevance_level absent when the call reached none. Same JSON as the other clients. */
export interface ToolResult {
  evidence_status: string; // "EVIDENCE_FOUND" | "NO_EVIDENCE"
  tool_call_id: string;
  query: string;
  evidence: ToolEvidence[];
  returned_count: number;
  relevance_level?: string; // "PRECISE" | "REFERENCE"
  truncated: boolean;
  /** A retrieval plan's FAQ direct answer, its evidence first. */
  faq_direct: boolean;
}

export interface ToolEvidence {
  document_id: string;
  source: string;
  title: string;
  breadcrumb: string;
  excerpt: string;
}

export function toolResultOf(m: LookupResult): ToolResult {
  return {
    evidence_status: strip(evidenceStatusToJSON(m.evidenceStatus), "EVIDENCE_STATUS_"),
    tool_call_id: m.toolCallId,
    query: m.query,
    evidence: m.evidence.map((e) => ({
      document_id: e.documentId,
      source: e.source,
      title: e.title,
      breadcrumb: e.breadcrumb,
      excerpt: e.excerpt,
    })),
    returned_count: m.returnedCount,
    ...(m.relevanceLevel !== undefined ? {
      relevance_level: strip(relevanceLevelToJSON(m.relevanceLevel), "RELEVANCE_LEVEL_"),
    } : {}),
    truncated: m.truncated,
    faq_direct: m.faqDirect,
  };
}

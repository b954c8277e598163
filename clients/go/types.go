package retrieval

import (
	"encoding/json"
	"strings"

	pb "retrieval.internal/clients/go/gen/retrieval/v1"
)

// Outcome is the typed result of one attempt (AttemptOutcome without its prefix).
type Outcome string

// The outcomes the service documents (README "Outcomes").
const (
	OutcomeUnspecified      Outcome = "UNSPECIFIED"
	OutcomeEvidenceFound    Outcome = "EVIDENCE_FOUND"
	OutcomeEmpty            Outcome = "EMPTY"
	OutcomeInsufficient     Outcome = "INSUFFICIENT"
	OutcomeInadmissible     Outcome = "INADMISSIBLE"
	OutcomeTimeout          Outcome = "TIMEOUT"
	OutcomeBackendError     Outcome = "BACKEND_ERROR"
	OutcomeBudgetDenied     Outcome = "BUDGET_DENIED"
	OutcomePermissionDenied Outcome = "PERMISSION_DENIED"
	OutcomeCancelled        Outcome = "CANCELLED"
)

// IsInfrastructureFailure is true when the backend, not the knowledge base, is why there
// is no evidence (TIMEOUT, BACKEND_ERROR): never read it as "nothing exists".
func (o Outcome) IsInfrastructureFailure() bool {
	return o == OutcomeTimeout || o == OutcomeBackendError
}

func outcomeOf(v pb.AttemptOutcome) Outcome {
	return Outcome(strings.TrimPrefix(v.String(), "ATTEMPT_OUTCOME_"))
}

// Leg is how one leg (BM25, KNN, RERANK) went.
type Leg struct {
	Kind      string // "BM25" | "KNN" | "RERANK"
	Status    string // "OK" | "TIMEOUT" | "ERROR" | "SKIPPED"
	LatencyMs float64
	HitCount  uint32
	Detail    string
}

func legOf(m *pb.LegReport) Leg {
	return Leg{
		Kind:      strings.TrimPrefix(m.GetKind().String(), "LEG_KIND_"),
		Status:    strings.TrimPrefix(m.GetStatus().String(), "LEG_STATUS_"),
		LatencyMs: m.GetLatencyMs(),
		HitCount:  m.GetHitCount(),
		Detail:    m.GetDetail(),
	}
}

// Evidence is one returned item; EvidenceID (`source#chunk@version`) is what a run cites.
type Evidence struct {
	EvidenceID  string
	SourceID    string
	Version     string
	Title       string
	Breadcrumb  string
	Excerpt     string
	Context     string
	Rank        uint32
	Quality     float64
	FusedScore  float64
	BM25Score   *float64 // nil when the lexical leg did not find it
	DenseScore  *float64 // nil when the vector leg did not find it
	RerankScore *float64 // nil when it was not reranked
	Metadata    map[string]string
}

func evidenceOf(m *pb.EvidenceItem) Evidence {
	return Evidence{
		EvidenceID: m.GetEvidenceId(), SourceID: m.GetSourceId(), Version: m.GetVersion(),
		Title: m.GetTitle(), Breadcrumb: m.GetBreadcrumb(), Excerpt: m.GetExcerpt(),
		Context: m.GetContext(), Rank: m.GetRank(), Quality: m.GetQuality(),
		FusedScore: m.GetFusedScore(), BM25Score: m.Bm25Score, DenseScore: m.DenseScore,
		RerankScore: m.RerankScore, Metadata: m.GetMetadata(),
	}
}

// Attempt is the closing AttemptResult of a Retrieve stream with the evidence before it.
type Attempt struct {
	AttemptID      string
	Outcome        Outcome
	RelevanceLevel string // "PRECISE" | "HIGHLY_RELEVANT" | "REFERENCE" | "" (none)
	Degraded       bool
	Truncated      bool
	StoppingReason string
	Legs           []Leg
	Evidence       []Evidence
	// Raw is the AttemptResult as received, for the fields not copied above.
	Raw *pb.AttemptResult
}

// Found is true when admissible evidence came back.
func (a *Attempt) Found() bool { return a.Outcome == OutcomeEvidenceFound }

func attemptOf(m *pb.AttemptResult, evidence []Evidence) *Attempt {
	legs := make([]Leg, 0, len(m.GetLegs()))
	for _, l := range m.GetLegs() {
		legs = append(legs, legOf(l))
	}
	return &Attempt{
		AttemptID: m.GetAttemptId(), Outcome: outcomeOf(m.GetOutcome()),
		RelevanceLevel: relevanceOf(m.GetRelevanceLevel()), Degraded: m.GetDegraded(),
		Truncated: m.GetTruncated(), StoppingReason: m.GetStoppingReason(), Legs: legs,
		Evidence: evidence, Raw: m,
	}
}

func relevanceOf(v pb.RelevanceLevel) string {
	if v == pb.RelevanceLevel_RELEVANCE_LEVEL_UNSPECIFIED {
		return ""
	}
	return strings.TrimPrefix(v.String(), "RELEVANCE_LEVEL_")
}

// Event is one element of the Retrieve stream: exactly one field is set.
type Event struct {
	Leg      *Leg
	Evidence *Evidence
	// Result closes the stream (always last, exactly once); Evidence is left empty here,
	// the events before it carried the items.
	Result *Attempt
}

func eventOf(m *pb.RetrieveEvent) Event {
	switch e := m.GetEvent().(type) {
	case *pb.RetrieveEvent_Leg:
		leg := legOf(e.Leg)
		return Event{Leg: &leg}
	case *pb.RetrieveEvent_Evidence:
		item := evidenceOf(e.Evidence)
		return Event{Evidence: &item}
	case *pb.RetrieveEvent_Result:
		return Event{Result: attemptOf(e.Result, nil)}
	}
	return Event{}
}

// ToolResult is Lookup's agent projection. json.Marshal gives the tool-result JSON the
// other clients give: snake_case names, enum values without their prefixes
// (EVIDENCE_FOUND / NO_EVIDENCE, PRECISE / REFERENCE), relevance_level absent when the
// call reached none.
type ToolResult struct {
	EvidenceStatus string         `json:"evidence_status"`
	ToolCallID     string         `json:"tool_call_id"`
	Query          string         `json:"query"`
	Evidence       []ToolEvidence `json:"evidence"`
	ReturnedCount  uint32         `json:"returned_count"`
	RelevanceLevel string         `json:"relevance_level,omitempty"`
	Truncated      bool           `json:"truncated"`
	// FaqDirect: a retrieval plan's FAQ direct answer, its evidence first.
	FaqDirect bool `json:"faq_direct"`
}

// ToolEvidence is one piece of evidence as an agent sees it.
type ToolEvidence struct {
	DocumentID string `json:"document_id"`
	Source     string `json:"source"`
	Title      string `json:"title"`
	Breadcrumb string `json:"breadcrumb"`
	Excerpt    string `json:"excerpt"`
}

// JSON is the tool result serialised, ready to hand to an LLM.
func (r *ToolResult) JSON() string {
	out, err := json.Marshal(r)
	if err != nil { // only plain strings, numbers and bools: cannot fail
		panic(err)
	}
	return string(out)
}

func toolResultOf(m *pb.LookupResult) *ToolResult {
	evidence := make([]ToolEvidence, 0, len(m.GetEvidence()))
	for _, e := range m.GetEvidence() {
		evidence = append(evidence, ToolEvidence{
			DocumentID: e.GetDocumentId(), Source: e.GetSource(), Title: e.GetTitle(),
			Breadcrumb: e.GetBreadcrumb(), Excerpt: e.GetExcerpt(),
		})
	}
	level := ""
	if m.RelevanceLevel != nil {
		level = strings.TrimPrefix(m.GetRelevanceLevel().String(), "RELEVANCE_LEVEL_")
	}
	return &ToolResult{
		EvidenceStatus: strings.TrimPrefix(m.GetEvidenceStatus().String(), "EVIDENCE_STATUS_"),
		ToolCallID:     m.GetToolCallId(), Query: m.GetQuery(), Evidence: evidence,
		ReturnedCount: m.GetReturnedCount(), RelevanceLevel: level, Truncated: m.GetTruncated(),
		FaqDirect: m.GetFaqDirect(),
	}
}

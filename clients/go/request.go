package retrieval

import (
	pb "retrieval.internal/clients/go/gen/retrieval/v1"
)

// Request is one retrieval attempt in plain Go values. Names the server does not know
// (a collection "wiki", a leg "grep") are sent as UNSPECIFIED, which the server rejects
// with INVALID_ARGUMENT naming the field, exactly as from the other clients.
type Request struct {
	Query string
	TopK  uint32 // 1..max_top_k (server config, default 50); 0 means 10
	// RunID groups attempts into a run with a budget; Budget creates it on first use.
	RunID  string
	Budget *Budget
	// Filters, applied inside the engine queries.
	Collections []string          // "doc", "faq"; empty = every collection
	SourceIDs   []string          // empty = every source
	Metadata    map[string]string // exact equality, e.g. {"category": "pricing"}
	// Options.
	Legs            []string // "bm25", "knn", "knn_latin"; empty = the server's default legs
	Rerank          *bool    // nil = server default
	MinQuality      float64  // 0 = server default
	MaxContextChars uint32   // 0 = server default
	ToolCallID      string   // echoed in the Lookup result
	VersionPins     map[string]string
	Gap             *pb.EvidenceGap
}

// Budget bounds what one run may spend (0 = server default).
type Budget struct {
	MaxSearches         uint32
	MaxResultsPerSearch uint32
}

// DefaultTopK is the top_k of a Request that leaves it 0 (as the other clients).
const DefaultTopK = 10

var collections = map[string]pb.Collection{"doc": pb.Collection_COLLECTION_DOC, "faq": pb.Collection_COLLECTION_FAQ}
var legKinds = map[string]pb.LegKind{"bm25": pb.LegKind_LEG_KIND_BM25, "knn": pb.LegKind_LEG_KIND_KNN, "knn_latin": pb.LegKind_LEG_KIND_KNN_LATIN}

// Proto is the request as sent.
func (r Request) Proto() *pb.RetrieveRequest {
	topK := r.TopK
	if topK == 0 {
		topK = DefaultTopK
	}
	req := &pb.RetrieveRequest{
		Query: r.Query, TopK: topK, RunId: r.RunID, ToolCallId: r.ToolCallID,
		VersionPins: r.VersionPins, Gap: r.Gap,
		Filters: &pb.Filters{SourceIds: r.SourceIDs, Metadata: r.Metadata},
		Options: &pb.RetrievalOptions{MinQuality: r.MinQuality, MaxContextChars: r.MaxContextChars},
	}
	for _, c := range r.Collections {
		req.Filters.Collections = append(req.Filters.Collections, collections[c])
	}
	for _, l := range r.Legs {
		req.Options.Legs = append(req.Options.Legs, legKinds[l])
	}
	if r.Rerank != nil {
		req.Options.Rerank = pb.RerankMode_RERANK_MODE_OFF
		if *r.Rerank {
			req.Options.Rerank = pb.RerankMode_RERANK_MODE_ON
		}
	}
	if r.Budget != nil {
		req.Budget = &pb.RunBudget{MaxSearches: r.Budget.MaxSearches, MaxResultsPerSearch: r.Budget.MaxResultsPerSearch}
	}
	return req
}

// Command golden runs the shared golden scenarios (tests/e2e/clients/golden_scenarios.json)
// through the Go client and prints the transcript as JSON; tests/e2e/clients/test_golden.py
// compares it with the Python and TypeScript clients' transcripts.
//
//	go run ./cmd/golden -target 127.0.0.1:50051 -scenarios ../../tests/e2e/clients/golden_scenarios.json
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"

	retrieval "retrieval.internal/clients/go"
)

type request struct {
	Query       string            `json:"query"`
	TopK        uint32            `json:"top_k"`
	RunID       string            `json:"run_id"`
	Budget      *budget           `json:"budget"`
	Collections []string          `json:"collections"`
	SourceIDs   []string          `json:"source_ids"`
	Metadata    map[string]string `json:"metadata"`
	Legs        []string          `json:"legs"`
	MinQuality  float64           `json:"min_quality"`
	ToolCallID  string            `json:"tool_call_id"`
}

type budget struct {
	MaxSearches uint32 `json:"max_searches"`
}

type step struct {
	Call    string  `json:"call"`
	As      string  `json:"as"`
	Request request `json:"request"`
}

type scenarioFile struct {
	APIKeys   map[string]string `json:"api_keys"`
	Scenarios []struct {
		Name  string `json:"name"`
		Steps []step `json:"steps"`
	} `json:"scenarios"`
}

type object = map[string]any

func main() {
	target := flag.String("target", "127.0.0.1:50051", "server address")
	path := flag.String("scenarios", "", "scenario file")
	client := flag.String("client", "go", "appended to run ids so each client has its own runs")
	flag.Parse()
	raw, err := os.ReadFile(*path)
	check(err)
	var file scenarioFile
	check(json.Unmarshal(raw, &file))

	clients := map[string]*retrieval.Client{}
	clientFor := func(principal string) *retrieval.Client {
		if c, ok := clients[principal]; ok {
			return c
		}
		c, err := retrieval.Dial(*target, retrieval.WithAPIKey(file.APIKeys[principal]))
		check(err)
		clients[principal] = c
		return c
	}
	out := []object{}
	for _, sc := range file.Scenarios {
		steps := []object{}
		for _, st := range sc.Steps {
			principal := st.As
			if principal == "" {
				principal = "public"
			}
			steps = append(steps, run(clientFor(principal), st, *client))
		}
		out = append(out, object{"name": sc.Name, "steps": steps})
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetEscapeHTML(false)
	check(enc.Encode(object{"client": "go", "scenarios": out}))
}

func run(c *retrieval.Client, st step, clientName string) object {
	r := st.Request
	req := retrieval.Request{
		Query: r.Query, TopK: r.TopK, Collections: r.Collections, SourceIDs: r.SourceIDs,
		Metadata: r.Metadata, Legs: r.Legs, MinQuality: r.MinQuality, ToolCallID: r.ToolCallID,
	}
	if r.RunID != "" {
		req.RunID = r.RunID + "-" + clientName
	}
	if r.Budget != nil {
		req.Budget = &retrieval.Budget{MaxSearches: r.Budget.MaxSearches}
	}
	ctx := context.Background()
	switch st.Call {
	case "retrieve":
		attempt, err := c.Retrieve(ctx, req)
		if err != nil {
			return object{"error": errorOf(err)}
		}
		return attemptOf(attempt)
	case "lookup":
		res, err := c.Lookup(ctx, req)
		if err != nil {
			return object{"error": errorOf(err)}
		}
		var tool object
		check(json.Unmarshal([]byte(res.JSON()), &tool))
		return object{"tool_result": tool}
	case "cancel_after_first_event":
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		seen := []string{}
		for ev, err := range c.Stream(ctx, req) {
			if err != nil {
				return object{"events_before_cancel": seen, "error": errorOf(err)}
			}
			seen = append(seen, kindOf(ev))
			cancel() // the caller goes away after the first event
		}
		return object{"events_before_cancel": seen, "error": nil}
	}
	panic("unknown call " + st.Call)
}

func kindOf(ev retrieval.Event) string {
	switch {
	case ev.Leg != nil:
		return "leg"
	case ev.Evidence != nil:
		return "evidence"
	}
	return "result"
}

func attemptOf(a *retrieval.Attempt) object {
	legs := object{}
	for _, l := range a.Legs {
		legs[l.Kind] = l.Status
	}
	evidence := []object{}
	for _, e := range a.Evidence {
		evidence = append(evidence, object{"rank": e.Rank, "evidence_id": e.EvidenceID, "quality": e.Quality})
	}
	return object{
		"outcome": string(a.Outcome), "infrastructure_failure": a.Outcome.IsInfrastructureFailure(),
		"relevance_level": a.RelevanceLevel, "stopping_reason": a.StoppingReason,
		"degraded": a.Degraded, "legs": legs, "evidence": evidence,
	}
}

func errorOf(err error) object {
	var rerr *retrieval.Error
	if !errors.As(err, &rerr) {
		panic(fmt.Sprintf("untyped error: %v", err))
	}
	fields := rerr.Fields()
	sort.Strings(fields)
	return object{"code": retrieval.CodeName(rerr.Code), "fields": fields, "attempt_recorded": rerr.AttemptID != ""}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

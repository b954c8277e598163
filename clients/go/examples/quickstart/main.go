package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	retrieval "retrieval.internal/clients/go"
)

func main() {
	target := os.Getenv("RETRIEVAL_TARGET") // e.g. 127.0.0.1:50051 (make run)
	if target == "" {
		target = "127.0.0.1:50051"
	}
	client, err := retrieval.Dial(target, retrieval.WithAPIKey(os.Getenv("RETRIEVAL_API_KEY")))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	ctx := context.Background() // no deadline here: the client's default (10 s) applies

	attempt, err := client.Retrieve(ctx, retrieval.Request{Query: "how do I reset my password", TopK: 3})
	var rerr *retrieval.Error
	if errors.As(err, &rerr) && errors.Is(err, retrieval.ErrInvalidArgument) {
		log.Fatalf("bad fields: %v", rerr.Fields())
	} else if err != nil {
		log.Fatal(err)
	}
	if attempt.Outcome.IsInfrastructureFailure() { // TIMEOUT / BACKEND_ERROR: not "no evidence"
		log.Fatalf("retrieval failed: %s", attempt.Outcome)
	}
	for _, e := range attempt.Evidence {
		fmt.Println(e.Rank, e.EvidenceID, e.Title)
	}
	fmt.Println("outcome:", attempt.Outcome)

	// The agent projection, ready to hand to an LLM as a tool result.
	tool, err := client.Lookup(ctx, retrieval.Request{Query: "如何开具发票", TopK: 1, ToolCallID: "call-1"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(tool.JSON())
}

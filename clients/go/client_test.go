package retrieval_test

// These tests run against a live server with the demo corpus and API keys on; pytest
// starts it (tests/e2e/clients/test_go_client.py) and passes RETRIEVAL_TARGET,
// RETRIEVAL_API_KEY (a principal in the "support" group) and RETRIEVAL_PUBLIC_API_KEY.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"

	retrieval "retrieval.internal/clients/go"
)

func server(t *testing.T) (target, supportKey, publicKey string) {
	t.Helper()
	target = os.Getenv("RETRIEVAL_TARGET")
	if target == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("RETRIEVAL_TARGET is not set: run through tests/e2e/clients/test_go_client.py")
		}
		t.Skip("RETRIEVAL_TARGET is not set: these tests need the live server pytest starts (tests/e2e/clients/test_go_client.py)")
	}
	return target, os.Getenv("RETRIEVAL_API_KEY"), os.Getenv("RETRIEVAL_PUBLIC_API_KEY")
}

func dial(t *testing.T, target string, opts ...retrieval.Option) *retrieval.Client {
	t.Helper()
	c, err := retrieval.Dial(target, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func asError(t *testing.T, err error) *retrieval.Error {
	t.Helper()
	var rerr *retrieval.Error
	if !errors.As(err, &rerr) {
		t.Fatalf("want a *retrieval.Error, got %T %v", err, err)
	}
	return rerr
}

func TestRetrieveReturnsATypedAttempt(t *testing.T) {
	target, key, _ := server(t)
	c := dial(t, target, retrieval.WithAPIKey(key))
	ctx := context.Background()

	a, err := c.Retrieve(ctx, retrieval.Request{Query: "how do I reset my password", TopK: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !a.Found() || a.Outcome != retrieval.OutcomeEvidenceFound || a.Outcome.IsInfrastructureFailure() {
		t.Fatalf("outcome %s", a.Outcome)
	}
	if len(a.Evidence) != 2 || a.Evidence[0].SourceID != "kb-password-reset" || a.Evidence[0].Rank != 1 || a.Evidence[1].Rank != 2 {
		t.Fatalf("evidence %+v", a.Evidence)
	}
	kinds := []string{}
	for _, l := range a.Legs {
		kinds = append(kinds, l.Kind)
	}
	slices.Sort(kinds)
	if !slices.Equal(kinds, []string{"BM25", "KNN", "KNN_LATIN", "RERANK"}) {
		t.Fatalf("legs %v", kinds)
	}
	record, err := c.GetAttempt(ctx, a.AttemptID)
	if err != nil || record.GetQuery() != "how do I reset my password" || record.GetPrincipal() != "support-bot" {
		t.Fatalf("ledger record %v %v", record, err)
	}

	empty, err := c.Retrieve(ctx, retrieval.Request{Query: "password", SourceIDs: []string{"nope"}})
	if err != nil || empty.Outcome != retrieval.OutcomeEmpty || empty.Outcome.IsInfrastructureFailure() || len(empty.Evidence) != 0 {
		t.Fatalf("empty %+v %v", empty, err)
	}
	for _, o := range []retrieval.Outcome{retrieval.OutcomeTimeout, retrieval.OutcomeBackendError} {
		if !o.IsInfrastructureFailure() {
			t.Fatalf("%s must be an infrastructure failure", o)
		}
	}
}

func TestStreamYieldsLegsThenEvidenceThenOneResult(t *testing.T) {
	target, key, _ := server(t)
	c := dial(t, target, retrieval.WithAPIKey(key))
	kinds := []string{}
	for ev, err := range c.Stream(context.Background(), retrieval.Request{Query: "cancel my subscription", TopK: 3}) {
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case ev.Leg != nil:
			kinds = append(kinds, "leg")
		case ev.Evidence != nil:
			kinds = append(kinds, "evidence")
		case ev.Result != nil:
			kinds = append(kinds, "result")
		}
	}
	if got := strings.Join(kinds, ","); got != "leg,leg,leg,evidence,evidence,evidence,result" {
		t.Fatalf("events %s", got)
	}
	// Leaving the loop early cancels the call and leaves the client usable.
	for range c.Stream(context.Background(), retrieval.Request{Query: "how do I reset my password"}) {
		break
	}
	if _, err := c.Retrieve(context.Background(), retrieval.Request{Query: "how do I reset my password", TopK: 1}); err != nil {
		t.Fatal(err)
	}
}

func TestErrorsAreTypedWithTheirDetails(t *testing.T) {
	target, key, _ := server(t)
	c := dial(t, target, retrieval.WithAPIKey(key))
	ctx := context.Background()

	_, err := c.Retrieve(ctx, retrieval.Request{Query: "", TopK: 999, Collections: []string{"wiki"}})
	if !errors.Is(err, retrieval.ErrInvalidArgument) {
		t.Fatalf("want ErrInvalidArgument, got %v", err)
	}
	fields := asError(t, err).Fields()
	slices.Sort(fields)
	if !slices.Equal(fields, []string{"filters.collections[0]", "query", "top_k"}) {
		t.Fatalf("field violations %v", fields)
	}
	if _, err := c.GetAttempt(ctx, "missing"); !errors.Is(err, retrieval.ErrNotFound) {
		t.Fatalf("want ErrNotFound, got %v", err)
	}
	_, err = dial(t, target, retrieval.WithAPIKey("wrong")).Retrieve(ctx, retrieval.Request{Query: "how do I reset my password"})
	if !errors.Is(err, retrieval.ErrUnauthenticated) || asError(t, err).Code != codes.Unauthenticated {
		t.Fatalf("want ErrUnauthenticated, got %v", err)
	}
	// A budget of one search: the second attempt is BUDGET_DENIED in-band, Lookup's is an error.
	run := "go-test-budget-" + time.Now().Format("150405.000000")
	req := retrieval.Request{Query: "how do I reset my password", TopK: 1, RunID: run, Budget: &retrieval.Budget{MaxSearches: 1}}
	if a, err := c.Retrieve(ctx, req); err != nil || a.Outcome != retrieval.OutcomeEvidenceFound {
		t.Fatalf("first attempt %v %v", a, err)
	}
	if a, err := c.Retrieve(ctx, req); err != nil || a.Outcome != retrieval.OutcomeBudgetDenied {
		t.Fatalf("second attempt %v %v", a, err)
	}
	_, err = c.Lookup(ctx, req)
	if !errors.Is(err, retrieval.ErrBudgetExhausted) || asError(t, err).AttemptID == "" {
		t.Fatalf("want ErrBudgetExhausted with the attempt id, got %v", err)
	}
}

func TestACLsComeFromTheAPIKey(t *testing.T) {
	target, supportKey, publicKey := server(t)
	req := retrieval.Request{Query: "orion-pager escalation", TopK: 3}
	support, err := dial(t, target, retrieval.WithAPIKey(supportKey)).Retrieve(context.Background(), req)
	if err != nil || support.Evidence[0].SourceID != "internal-escalation" {
		t.Fatalf("support caller %+v %v", support, err)
	}
	public, err := dial(t, target, retrieval.WithAPIKey(publicKey)).Retrieve(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range public.Evidence {
		if e.SourceID == "internal-escalation" {
			t.Fatal("a caller outside the support group saw internal-escalation")
		}
	}
}

func TestLookupIsToolResultJSON(t *testing.T) {
	target, key, _ := server(t)
	c := dial(t, target, retrieval.WithAPIKey(key))
	found, err := c.Lookup(context.Background(), retrieval.Request{Query: "如何开具发票", TopK: 1, ToolCallID: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	var tool map[string]any
	if err := json.Unmarshal([]byte(found.JSON()), &tool); err != nil {
		t.Fatal(err)
	}
	if tool["evidence_status"] != "EVIDENCE_FOUND" || tool["tool_call_id"] != "t1" || tool["returned_count"] != 1.0 {
		t.Fatalf("tool result %s", found.JSON())
	}
	if src := tool["evidence"].([]any)[0].(map[string]any)["source"]; src != "faq-invoice-zh" {
		t.Fatalf("source %v", src)
	}
	none, err := c.Lookup(context.Background(), retrieval.Request{Query: "zebra", TopK: 1, MinQuality: 0.99})
	if err != nil {
		t.Fatal(err)
	}
	if js := none.JSON(); !strings.Contains(js, `"evidence_status":"NO_EVIDENCE"`) || strings.Contains(js, "relevance_level") ||
		!strings.Contains(js, `"evidence":[]`) {
		t.Fatalf("no-evidence tool result %s", js)
	}
}

func TestEveryCallHasADeadline(t *testing.T) {
	target, key, _ := server(t)
	// No deadline on the context: the client's default applies (here far too short).
	c := dial(t, target, retrieval.WithAPIKey(key), retrieval.WithTimeout(time.Microsecond))
	_, err := c.Retrieve(context.Background(), retrieval.Request{Query: "how do I reset my password"})
	if !errors.Is(err, retrieval.ErrBackendTimeout) {
		t.Fatalf("want DEADLINE_EXCEEDED from the default deadline, got %v", err)
	}
	// A caller's own deadline wins over the default.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Retrieve(ctx, retrieval.Request{Query: "how do I reset my password", TopK: 1}); err != nil {
		t.Fatal(err)
	}
}

func TestCancellingTheContextEndsTheStreamAsCancelled(t *testing.T) {
	target, key, _ := server(t)
	c := dial(t, target, retrieval.WithAPIKey(key))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var seen int
	var last error
	for _, err := range c.Stream(ctx, retrieval.Request{Query: "cancel my subscription", TopK: 5}) {
		if err != nil {
			last = err
			break
		}
		seen++
		cancel()
	}
	if seen != 1 || !errors.Is(last, retrieval.ErrCancelled) {
		t.Fatalf("seen %d events, then %v", seen, last)
	}
}

// countingDial counts unary tries and reconnects fast, so retries are observable.
func countingDial(tries *atomic.Int32) retrieval.Option {
	return retrieval.WithDialOptions(
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			tries.Add(1)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.2, MaxDelay: 50 * time.Millisecond}, MinConnectTimeout: time.Second}),
	)
}

func TestOnlyIdempotentUnaryCallsRetryUnavailable(t *testing.T) {
	target, key, _ := server(t)
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := listener.Addr().String()
	listener.Close() // nothing listens here: every call is UNAVAILABLE

	var tries atomic.Int32
	c := dial(t, down, retrieval.WithAPIKey(key), retrieval.WithRetries(3, 20*time.Millisecond), countingDial(&tries))
	ctx := context.Background()
	if _, err := c.GetAttempt(ctx, "x"); !errors.Is(err, retrieval.ErrUnavailable) || tries.Load() != 3 {
		t.Fatalf("GetAttempt: %v after %d tries, want UNAVAILABLE after 3", err, tries.Load())
	}
	tries.Store(0)
	if _, err := c.Lookup(ctx, retrieval.Request{Query: "how do I reset my password"}); !errors.Is(err, retrieval.ErrUnavailable) || tries.Load() != 3 {
		t.Fatalf("Lookup without a run: %v after %d tries, want 3", err, tries.Load())
	}
	tries.Store(0)
	if _, err := c.Lookup(ctx, retrieval.Request{Query: "how do I reset my password", RunID: "r"}); !errors.Is(err, retrieval.ErrUnavailable) || tries.Load() != 1 {
		t.Fatalf("Lookup in a run spends budget per try: %v after %d tries, want 1", err, tries.Load())
	}
	if _, err := c.Retrieve(ctx, retrieval.Request{Query: "how do I reset my password"}); !errors.Is(err, retrieval.ErrUnavailable) {
		t.Fatalf("Retrieve (a stream, never retried): %v", err)
	}

	// The server comes back while the client waits between tries: the call succeeds.
	listener2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	late := listener2.Addr().String()
	listener2.Close()
	tries.Store(0)
	c2 := dial(t, late, retrieval.WithAPIKey(key), retrieval.WithRetries(5, 150*time.Millisecond), countingDial(&tries))
	go func() {
		time.Sleep(100 * time.Millisecond)
		proxy(t, late, target)
	}()
	if _, err := c2.Lookup(ctx, retrieval.Request{Query: "how do I reset my password", TopK: 1}); err != nil || tries.Load() < 2 {
		t.Fatalf("Lookup after the server came back: %v after %d tries", err, tries.Load())
	}
}

// proxy forwards TCP from listen to target until the test ends.
func proxy(t *testing.T, listen, target string) {
	l, err := net.Listen("tcp", listen)
	if err != nil {
		t.Error(err)
		return
	}
	t.Cleanup(func() { l.Close() })
	for {
		in, err := l.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", target)
		if err != nil {
			in.Close()
			continue
		}
		go func() { io.Copy(out, in); out.Close() }()
		go func() { io.Copy(in, out); in.Close() }()
	}
}

func TestTLS(t *testing.T) {
	_, key, _ := server(t)
	target, caFile := os.Getenv("RETRIEVAL_TLS_TARGET"), os.Getenv("RETRIEVAL_TLS_CA")
	if target == "" || caFile == "" {
		t.Fatal("RETRIEVAL_TLS_TARGET / RETRIEVAL_TLS_CA not set by the harness")
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatal("no certificate in " + caFile)
	}
	c := dial(t, target, retrieval.WithAPIKey(key), retrieval.WithTLS(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}))
	if a, err := c.Retrieve(context.Background(), retrieval.Request{Query: "how do I reset my password", TopK: 1}); err != nil || !a.Found() {
		t.Fatalf("over TLS: %v %v", a, err)
	}
	// The system roots do not trust the test certificate; plaintext does not speak TLS.
	for name, opts := range map[string][]retrieval.Option{"system roots": {retrieval.WithTLS(nil)}, "plaintext": nil} {
		c := dial(t, target, append(opts, retrieval.WithAPIKey(key), retrieval.WithTimeout(2*time.Second))...)
		if _, err := c.GetAttempt(context.Background(), "x"); err == nil || errors.Is(err, retrieval.ErrNotFound) {
			t.Fatalf("%s: the call reached the server: %v", name, err)
		}
	}
}

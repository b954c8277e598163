// Package retrieval is the Go client of the retrieval.v1 gRPC service: typed attempts,
// a typed outcome that never confuses a failure with "no evidence", typed errors with the
// google.rpc details, deadlines on every call and retries only where they are safe.
//
//	client, err := retrieval.Dial("127.0.0.1:50051", retrieval.WithAPIKey(key))
//	attempt, err := client.Retrieve(ctx, retrieval.Request{Query: "how do I reset my password", TopK: 3})
//	if attempt.Outcome.IsInfrastructureFailure() { ... } // TIMEOUT / BACKEND_ERROR
//
// The generated stubs are in the gen/retrieval/v1 package (`make proto` regenerates them).
package retrieval

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"iter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	pb "retrieval.internal/clients/go/gen/retrieval/v1"
)

// DefaultTimeout bounds a call whose context carries no deadline (the server's own
// default_deadline_s is 10 s too).
const DefaultTimeout = 10 * time.Second

type options struct {
	apiKey      string
	creds       credentials.TransportCredentials
	timeout     time.Duration
	maxAttempts int
	backoff     time.Duration
	dialOptions []grpc.DialOption
}

// Option configures a Client.
type Option func(*options)

// WithAPIKey sends `x-api-key` on every call; the server maps it to a principal and its
// ACL groups (a caller never asserts its own groups).
func WithAPIKey(key string) Option { return func(o *options) { o.apiKey = key } }

// WithTLS connects over TLS with this configuration (nil: the system roots). Without it
// the connection is plaintext, as the server's default loopback listener expects.
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		o.creds = credentials.NewTLS(cfg)
	}
}

// WithTimeout sets the deadline given to calls whose context has none (DefaultTimeout).
func WithTimeout(d time.Duration) Option { return func(o *options) { o.timeout = d } }

// WithRetries sets how many times an idempotent unary call is tried in all when it fails
// with UNAVAILABLE (default 3; 1 disables retries), starting with this backoff, doubled
// after each try, always within the call's deadline.
func WithRetries(attempts int, backoff time.Duration) Option {
	return func(o *options) { o.maxAttempts, o.backoff = max(attempts, 1), backoff }
}

// WithDialOptions passes extra options to grpc.NewClient (interceptors, keepalive, ...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOptions = append(o.dialOptions, opts...) }
}

// Client is safe for concurrent use; make one per target and reuse it.
type Client struct {
	conn      *grpc.ClientConn
	opts      options
	Retrieval pb.RetrievalServiceClient // the raw stubs, for what the wrapper does not cover
	Corpus    pb.CorpusServiceClient
}

// Dial creates a client for target ("host:port"); the connection is made lazily.
func Dial(target string, opts ...Option) (*Client, error) {
	o := options{timeout: DefaultTimeout, maxAttempts: 3, backoff: 200 * time.Millisecond,
		creds: insecure.NewCredentials()}
	for _, opt := range opts {
		opt(&o)
	}
	conn, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(o.creds)}, o.dialOptions...)...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, opts: o, Retrieval: pb.NewRetrievalServiceClient(conn), Corpus: pb.NewCorpusServiceClient(conn)}, nil
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// callContext adds the default deadline when the caller set none, and the API key.
func (c *Client) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	cancel := context.CancelFunc(func() {})
	if _, ok := ctx.Deadline(); !ok {
		ctx, cancel = context.WithTimeout(ctx, c.opts.timeout)
	}
	if c.opts.apiKey != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-api-key", c.opts.apiKey)
	}
	return ctx, cancel
}

// unary runs one unary call, retrying UNAVAILABLE when idempotent says it is safe.
func unary[T any](ctx context.Context, c *Client, idempotent bool, call func(context.Context, ...grpc.CallOption) (T, error)) (T, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	wait := c.opts.backoff
	for try := 1; ; try++ {
		var trailer metadata.MD
		res, err := call(ctx, grpc.Trailer(&trailer))
		if err == nil {
			return res, nil
		}
		mapped := fromRPC(err, trailer)
		var rerr *Error
		retry := idempotent && try < c.opts.maxAttempts && errors.As(mapped, &rerr) && rerr.Code == codes.Unavailable
		if deadline, ok := ctx.Deadline(); retry && ok && time.Until(deadline) <= wait {
			retry = false // no time left for another try
		}
		if !retry {
			return res, mapped
		}
		select {
		case <-time.After(wait):
			wait *= 2
		case <-ctx.Done():
			return res, fromRPC(ctx.Err(), nil)
		}
	}
}

// Stream runs one attempt and yields its events as they arrive: a Leg per leg, the
// Evidence in rank order, then the Result, always last. A failed call yields one
// non-nil error and ends. Breaking out of the loop cancels the call.
//
//	for ev, err := range client.Stream(ctx, req) { ... }
func (c *Client) Stream(ctx context.Context, req Request) iter.Seq2[Event, error] {
	return func(yield func(Event, error) bool) {
		ctx, cancel := c.callContext(ctx)
		defer cancel()
		stream, err := c.Retrieval.Retrieve(ctx, req.Proto())
		if err != nil {
			yield(Event{}, fromRPC(err, nil))
			return
		}
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if ctx.Err() != nil {
				// The caller cancelled (or the deadline passed): the stream ends here with
				// that code, even when more events were already buffered.
				yield(Event{}, fromRPC(ctx.Err(), nil))
				return
			}
			if err != nil {
				yield(Event{}, fromRPC(err, stream.Trailer()))
				return
			}
			if !yield(eventOf(m), nil) {
				return
			}
		}
	}
}

// Retrieve runs one attempt and collects it: the result with the evidence before it.
// Outcomes are in-band (Attempt.Outcome); an error is a transport-level failure.
func (c *Client) Retrieve(ctx context.Context, req Request) (*Attempt, error) {
	var evidence []Evidence
	for ev, err := range c.Stream(ctx, req) {
		switch {
		case err != nil:
			return nil, err
		case ev.Evidence != nil:
			evidence = append(evidence, *ev.Evidence)
		case ev.Result != nil:
			ev.Result.Evidence = evidence
			return ev.Result, nil
		}
	}
	return nil, &Error{Code: codes.Internal, Message: "stream ended without an AttemptResult"}
}

// Lookup runs the attempt and returns the agent projection (ToolResult; its JSON method
// is the tool result). Outcomes that are not "the search ran" are errors here:
// ErrBackendTimeout, ErrUnavailable, ErrBudgetExhausted, ErrPermissionDenied. Retried
// on UNAVAILABLE only without a RunID: with one, every try would spend the run's budget.
func (c *Client) Lookup(ctx context.Context, req Request) (*ToolResult, error) {
	res, err := unary(ctx, c, req.RunID == "", func(ctx context.Context, o ...grpc.CallOption) (*pb.LookupResult, error) {
		return c.Retrieval.Lookup(ctx, req.Proto(), o...)
	})
	if err != nil {
		return nil, err
	}
	return toolResultOf(res), nil
}

// GetAttempt reads one recorded attempt from the ledger (ErrNotFound when unknown).
func (c *Client) GetAttempt(ctx context.Context, attemptID string) (*pb.AttemptRecord, error) {
	res, err := unary(ctx, c, true, func(ctx context.Context, o ...grpc.CallOption) (*pb.GetAttemptResponse, error) {
		return c.Retrieval.GetAttempt(ctx, &pb.GetAttemptRequest{AttemptId: attemptID}, o...)
	})
	if err != nil {
		return nil, err
	}
	return res.GetAttempt(), nil
}

// GetEvidence reads the exact text of one `source#chunk@version`.
func (c *Client) GetEvidence(ctx context.Context, evidenceID string) (*pb.GetEvidenceResponse, error) {
	return unary(ctx, c, true, func(ctx context.Context, o ...grpc.CallOption) (*pb.GetEvidenceResponse, error) {
		return c.Corpus.GetEvidence(ctx, &pb.GetEvidenceRequest{EvidenceId: evidenceID}, o...)
	})
}

package retrieval

import (
	"errors"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The overload path needs a saturated server (tests/fault covers the server side); here
// the status the server builds for it (service/api/errors.py: RetryInfo + retry-after-ms)
// is decoded the way a live call's would be.
func TestOverloadCarriesRetryInfo(t *testing.T) {
	st, err := status.New(codes.ResourceExhausted, "too many attempts in flight").
		WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(250 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	got := fromRPC(st.Err(), nil)
	var rerr *Error
	if !errors.Is(got, ErrOverloaded) || !errors.As(got, &rerr) || rerr.RetryAfter != 250*time.Millisecond {
		t.Fatalf("got %#v", got)
	}
	// The trailer, when present, is what the server measured in milliseconds.
	got = fromRPC(st.Err(), metadata.Pairs("retry-after-ms", "400", "x-attempt-id", "a-1"))
	if !errors.As(got, &rerr) || rerr.RetryAfter != 400*time.Millisecond || rerr.AttemptID != "a-1" {
		t.Fatalf("got %#v", got)
	}
	if errors.Is(got, ErrUnavailable) || CodeName(rerr.Code) != "RESOURCE_EXHAUSTED" {
		t.Fatalf("kind mismatch: %v", got)
	}
}

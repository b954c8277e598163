package retrieval

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Error is every failed call: the gRPC code with the google.rpc details the service
// attaches. Match a kind with errors.Is (ErrInvalidArgument, ErrBudgetExhausted, ...) and
// read the details with errors.As:
//
//	var rerr *retrieval.Error
//	if errors.As(err, &rerr) && rerr.Code == codes.InvalidArgument { rerr.Fields() ... }
type Error struct {
	Code    codes.Code
	Message string
	// AttemptID is the `x-attempt-id` trailer when the call reached the attempt
	// (e.g. Lookup's TIMEOUT -> DEADLINE_EXCEEDED is recorded in the ledger).
	AttemptID string
	// FieldViolations: google.rpc.BadRequest on INVALID_ARGUMENT, one per bad field.
	FieldViolations []FieldViolation
	// RetryAfter: google.rpc.RetryInfo (or the retry-after-ms trailer) on RESOURCE_EXHAUSTED.
	RetryAfter time.Duration
}

// FieldViolation names one bad request field, e.g. "filters.collections[0]".
type FieldViolation struct {
	Field       string
	Description string
}

func (e *Error) Error() string {
	return fmt.Sprintf("retrieval: %s: %s", CodeName(e.Code), e.Message)
}

// Fields are the names of the bad fields of an INVALID_ARGUMENT.
func (e *Error) Fields() []string {
	out := make([]string, 0, len(e.FieldViolations))
	for _, v := range e.FieldViolations {
		out = append(out, v.Field)
	}
	return out
}

// GRPCStatus lets status.FromError / status.Code see the original code.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// Is makes errors.Is(err, ErrBudgetExhausted) and friends match on the code.
func (e *Error) Is(target error) bool {
	var k kind
	if errors.As(target, &k) {
		return k.code == e.Code
	}
	return false
}

type kind struct {
	code codes.Code
	name string
}

func (k kind) Error() string { return "retrieval: " + k.name }

// Kinds of Error, one per status the service documents (the Python client's classes).
var (
	ErrInvalidArgument  error = kind{codes.InvalidArgument, "invalid argument"}
	ErrOverloaded       error = kind{codes.ResourceExhausted, "overloaded"}
	ErrUnauthenticated  error = kind{codes.Unauthenticated, "unauthenticated"}
	ErrPermissionDenied error = kind{codes.PermissionDenied, "permission denied"}
	ErrNotFound         error = kind{codes.NotFound, "not found"}
	// ErrBudgetExhausted: Lookup's BUDGET_DENIED (FAILED_PRECONDITION).
	ErrBudgetExhausted error = kind{codes.FailedPrecondition, "budget exhausted"}
	// ErrBackendTimeout: Lookup's TIMEOUT, or the call's own deadline passed.
	ErrBackendTimeout error = kind{codes.DeadlineExceeded, "backend timeout"}
	// ErrUnavailable: Lookup's BACKEND_ERROR, or the server is unreachable or draining.
	ErrUnavailable error = kind{codes.Unavailable, "unavailable"}
	ErrCancelled   error = kind{codes.Canceled, "cancelled"}
)

// CodeName is the canonical upper-case name of a code ("INVALID_ARGUMENT"), as gRPC
// documents it and the other clients print it.
func CodeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return "CODE_" + strconv.Itoa(int(c))
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}

// fromRPC turns what a call returned into an *Error (nil stays nil). A context the caller
// cancelled or let expire is reported with its code even when gRPC saw no status.
func fromRPC(err error, trailer metadata.MD) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		switch {
		case errors.Is(err, context.Canceled):
			st = status.New(codes.Canceled, err.Error())
		case errors.Is(err, context.DeadlineExceeded):
			st = status.New(codes.DeadlineExceeded, err.Error())
		default:
			st = status.New(codes.Unknown, err.Error())
		}
	}
	out := &Error{Code: st.Code(), Message: st.Message()}
	if ids := trailer.Get("x-attempt-id"); len(ids) > 0 {
		out.AttemptID = ids[0]
	}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				out.FieldViolations = append(out.FieldViolations, FieldViolation{v.GetField(), v.GetDescription()})
			}
		case *errdetails.RetryInfo:
			out.RetryAfter = d.GetRetryDelay().AsDuration()
		}
	}
	if ms := trailer.Get("retry-after-ms"); len(ms) > 0 {
		if n, err := strconv.Atoi(ms[0]); err == nil {
			out.RetryAfter = time.Duration(n) * time.Millisecond
		}
	}
	return out
}

package protocol

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Errors a Conn reports about a packet; a *MessageError wraps exactly one of
// them. Any of them means the peer broke the protocol (or a local caller
// tried to), so the connection should be closed.
var (
	// ErrTooLarge: a packet longer than MaxMessageSize.
	ErrTooLarge = errors.New("message too large")
	// ErrMalformed: a packet that does not decode, or a message that breaks
	// the protocol's rules.
	ErrMalformed = errors.New("malformed message")
	// ErrTooManyFiles: more than MaxFiles file descriptors on one packet.
	ErrTooManyFiles = errors.New("too many files attached")
)

// MessageError reports a packet that could not be sent or received. Err is
// one of ErrTooLarge, ErrMalformed or ErrTooManyFiles, so callers test it with
// errors.Is; Cause, when set, is the underlying decoding or system error.
type MessageError struct {
	Op     string // "send", "recv" or "validate"
	Err    error  // ErrTooLarge, ErrMalformed or ErrTooManyFiles
	Detail string // what exactly was wrong, for logs
	Cause  error  // underlying error, or nil
}

func (e *MessageError) Error() string {
	s := "protocol: " + e.Op + ": " + e.Err.Error()
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Cause != nil {
		s += ": " + e.Cause.Error()
	}
	return s
}

// Unwrap returns Err and, when set, Cause.
func (e *MessageError) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Err}
	}
	return []error{e.Err, e.Cause}
}

// Errors carried by error responses, one per storev1.Error_Code other than
// OK. A *CodeError unwraps to the sentinel of its code, so
// errors.Is(err, protocol.ErrNotFound) works on errors decoded from
// responses, and CodeOf maps these sentinels (wrapped or not) back to codes.
var (
	ErrInvalid    = errors.New("invalid argument")
	ErrNotFound   = errors.New("not found")
	ErrExists     = errors.New("already exists")
	ErrTimeout    = errors.New("timed out")
	ErrStoreFull  = errors.New("store full")
	ErrPermission = errors.New("permission denied")
	ErrLimit      = errors.New("limit reached")
	ErrNotSealed  = errors.New("object not sealed")
	ErrSealed     = errors.New("object already sealed")
	ErrVersion    = errors.New("unsupported protocol version")
	ErrInternal   = errors.New("internal error")
	// ErrUnavailable: the cluster directory, or every live holder of the
	// object, cannot be reached now; a retry later may succeed.
	ErrUnavailable = errors.New("unavailable")
	// ErrDataLoss: a record or chunk the answer needs does not verify
	// (forged, written with another cluster secret, or corrupt); a retry
	// does not help.
	ErrDataLoss = errors.New("data does not verify")
)

var codeSentinels = map[storev1.Error_Code]error{
	storev1.Error_INVALID:     ErrInvalid,
	storev1.Error_NOT_FOUND:   ErrNotFound,
	storev1.Error_EXISTS:      ErrExists,
	storev1.Error_TIMEOUT:     ErrTimeout,
	storev1.Error_STORE_FULL:  ErrStoreFull,
	storev1.Error_PERMISSION:  ErrPermission,
	storev1.Error_LIMIT:       ErrLimit,
	storev1.Error_NOT_SEALED:  ErrNotSealed,
	storev1.Error_SEALED:      ErrSealed,
	storev1.Error_VERSION:     ErrVersion,
	storev1.Error_INTERNAL:    ErrInternal,
	storev1.Error_UNAVAILABLE: ErrUnavailable,
	storev1.Error_DATA_LOSS:   ErrDataLoss,
}

// codeOrder is the order CodeOf tries the sentinels in, for errors that
// match several: the specific cluster classes first (a pull that failed
// for want of a reachable holder may also wrap a holder's NOT_FOUND),
// then the rest in code order.
var codeOrder = []storev1.Error_Code{
	storev1.Error_DATA_LOSS, storev1.Error_UNAVAILABLE,
	storev1.Error_INVALID, storev1.Error_NOT_FOUND, storev1.Error_EXISTS, storev1.Error_TIMEOUT,
	storev1.Error_STORE_FULL, storev1.Error_PERMISSION, storev1.Error_LIMIT, storev1.Error_NOT_SEALED,
	storev1.Error_SEALED, storev1.Error_VERSION, storev1.Error_INTERNAL,
}

// Sentinel returns the sentinel error of code: ErrNotFound for NOT_FOUND,
// and so on; ErrInternal for codes this version does not know, nil for OK.
// It is the one table from codes to errors, which package client uses too.
func Sentinel(code storev1.Error_Code) error {
	if code == storev1.Error_OK {
		return nil
	}
	if s, ok := codeSentinels[code]; ok {
		return s
	}
	return ErrInternal
}

// CodeError is a failure with a protocol error code: what the server puts in
// an error response and what a client decodes from one.
type CodeError struct {
	Code    storev1.Error_Code
	Message string // detail for humans; may be empty
	// Limit says which limit a LIMIT error hit; LIMIT_UNSPECIFIED for
	// other codes and from servers that do not say.
	Limit storev1.Error_Limit
}

// Errorf returns a *CodeError with the given code and a formatted message.
func Errorf(code storev1.Error_Code, format string, args ...any) *CodeError {
	return &CodeError{Code: code, Message: fmt.Sprintf(format, args...)}
}

// LimitErrorf returns a LIMIT *CodeError saying which limit was hit, with a
// formatted message that should say what to do about it.
func LimitErrorf(limit storev1.Error_Limit, format string, args ...any) *CodeError {
	return &CodeError{Code: storev1.Error_LIMIT, Message: fmt.Sprintf(format, args...), Limit: limit}
}

// LimitOf returns which limit err (a LIMIT error) hit, or LIMIT_UNSPECIFIED.
func LimitOf(err error) storev1.Error_Limit {
	if ce, ok := errors.AsType[*CodeError](err); ok {
		return ce.Limit
	}
	return storev1.Error_LIMIT_UNSPECIFIED
}

func (e *CodeError) Error() string {
	s := codeText(e.Code)
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Unwrap returns the sentinel error of e.Code (ErrNotFound for NOT_FOUND, ...),
// or nil for OK and codes this version does not know.
func (e *CodeError) Unwrap() error { return codeSentinels[e.Code] }

func codeText(c storev1.Error_Code) string {
	if s, ok := codeSentinels[c]; ok {
		return s.Error()
	}
	if c == storev1.Error_OK {
		return "ok"
	}
	return fmt.Sprintf("error code %d", int32(c))
}

// CodeOf returns the protocol error code for err: OK for nil, the code of a
// *CodeError in err's chain, else the code whose sentinel err matches
// (errors.Is), else INTERNAL.
func CodeOf(err error) storev1.Error_Code {
	if err == nil {
		return storev1.Error_OK
	}
	if ce, ok := errors.AsType[*CodeError](err); ok {
		return ce.Code
	}
	// A fixed order, so that the answer does not depend on map order for
	// errors that match several sentinels.
	for _, c := range codeOrder {
		if errors.Is(err, codeSentinels[c]) {
			return c
		}
	}
	return storev1.Error_INTERNAL
}

// ErrorResponse returns the response that reports err to the request with
// the given id: code CodeOf(err) and err's text as the message, less the
// code's own name (the receiver's CodeError.Error adds it back). A nil err
// is reported as INTERNAL, since a response without body or error is
// invalid.
func ErrorResponse(id uint64, err error) *storev1.Response {
	if err == nil {
		err = Errorf(storev1.Error_INTERNAL, "no result")
	}
	code := CodeOf(err)
	if code == storev1.Error_OK {
		code = storev1.Error_INTERNAL
	}
	e := &storev1.Error{Code: code, Message: errorMessage(err)}
	if code == storev1.Error_LIMIT {
		e.Limit = LimitOf(err)
	}
	return &storev1.Response{Id: id, Error: e}
}

// errorMessage is err's text without the name of its code, which the
// receiver adds back (CodeError.Error), so that it is not said twice.
func errorMessage(err error) string {
	msg := err.Error()
	if ce, ok := errors.AsType[*CodeError](err); ok {
		if err == error(ce) {
			return ce.Message
		}
		if ce.Message == "" {
			return strings.TrimSuffix(msg, ": "+ce.Error())
		}
		return strings.Replace(msg, ce.Error(), ce.Message, 1)
	}
	if s := codeSentinels[CodeOf(err)]; s != nil {
		if msg == s.Error() {
			return ""
		}
		return strings.TrimSuffix(msg, ": "+s.Error())
	}
	return msg
}

// ResponseError returns nil when r reports success, else a *CodeError with
// r's error code and message.
func ResponseError(r *storev1.Response) error {
	e := r.GetError()
	if e.GetCode() == storev1.Error_OK {
		return nil
	}
	return &CodeError{Code: e.GetCode(), Message: e.GetMessage(), Limit: e.GetLimit()}
}

package protocol

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Names of the event kinds, as clients and people say them.
const (
	EventSealed  = "sealed"
	EventDeleted = "deleted"
	EventEvicted = "evicted"
	EventAborted = "aborted"
)

var eventNames = map[storev1.Event_Kind]string{
	storev1.Event_SEALED:  EventSealed,
	storev1.Event_DELETED: EventDeleted,
	storev1.Event_EVICTED: EventEvicted,
	storev1.Event_ABORTED: EventAborted,
}

// EventName returns the name of an event kind, or "" for a kind this
// version does not know (one from a newer server).
func EventName(k storev1.Event_Kind) string { return eventNames[k] }

// NewEvent returns the event packet (a Response with id 0) that tells
// subscribers that kind happened to the object name.
func NewEvent(kind storev1.Event_Kind, name string) *storev1.Response {
	return &storev1.Response{Body: &storev1.Response_Event{Event: &storev1.Event{Kind: kind, Name: name}}}
}

// ListPage returns the response to list request id holding the longest
// prefix of objects (sorted by name, starting after the request's
// start_after) that fits in one packet, with more set when some were left
// out. A page always holds at least the first object, so a client paging
// with start_after always progresses; should that one object not fit, Send
// reports ErrTooLarge (no ObjectInfo within the validation limits is that
// large unless its region is).
func ListPage(id uint64, objects []*storev1.ObjectInfo) *storev1.Response {
	list := &storev1.ListResponse{}
	resp := &storev1.Response{Id: id, Body: &storev1.Response_List{List: list}}
	// Headroom for the id, the list's own tag and length prefix and the
	// more flag: protowire sizes of at most 10+3+3+2 bytes.
	budget := MaxMessageSize - 32
	size := 0
	for i, o := range objects {
		n := protowire.SizeTag(1) + protowire.SizeBytes(proto.Size(o))
		if size+n > budget {
			if i == 0 {
				// Let the sender fail loudly with ErrTooLarge rather than
				// loop a client forever on empty pages.
				list.Objects = objects[:1]
			}
			list.More = true
			return resp
		}
		size += n
		list.Objects = objects[:i+1]
	}
	return resp
}

// ClientHello performs the client side of the handshake on a new
// connection: it sends a hello with the given client name and request id 1,
// and waits for the answer. On success it returns the server's hello; on a
// refusal, a *CodeError (ErrVersion when the server does not speak Version).
// If ctx ends first, ClientHello returns an error matching ctx.Err(); the
// handshake's state is then unknown and c should be closed.
func ClientHello(ctx context.Context, c *Conn, clientName string) (*storev1.HelloResponse, error) {
	if err := validateText("client name", clientName, MaxClientNameLen); err != nil {
		return nil, err
	}
	// A deadline in the past wakes a blocked Send or Recv when ctx ends.
	interrupted := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		c.uc.SetDeadline(time.Unix(1, 0))
		close(interrupted)
	})
	defer func() {
		if !stop() {
			// ctx ended: wait for the deadline to be set before clearing
			// it, so a handshake that won the race leaves c usable.
			<-interrupted
			c.uc.SetDeadline(time.Time{})
		}
	}()
	req := &storev1.Request{Id: 1, Body: &storev1.Request_Hello{Hello: &storev1.HelloRequest{
		Version: Version, ClientName: clientName}}}
	sendErr := c.Send(req)
	var resp storev1.Response
	files, err := c.Recv(&resp)
	if errors.Is(err, syscall.ECONNRESET) {
		// A daemon that refuses a peer at once (not admitted, over a
		// limit) sends its reason and closes, perhaps before reading the
		// hello; Linux then reports the reset first, and the reason,
		// still queued, on the next read.
		files, err = c.Recv(&resp)
	}
	if err != nil {
		if sendErr != nil {
			err = sendErr
		}
		return nil, ctxOr(ctx, err)
	}
	if err := ValidateResponse(&resp, len(files)); err != nil {
		CloseFiles(files)
		return nil, err
	}
	if err := ResponseError(&resp); err != nil {
		return nil, err
	}
	h := resp.GetHello()
	if resp.GetId() != 1 || h == nil {
		return nil, &MessageError{Op: "recv", Err: ErrMalformed, Detail: "the answer to hello is not a hello"}
	}
	if h.GetVersion() != Version {
		return nil, fmt.Errorf("protocol: server answered with version %d, want %d: %w", h.GetVersion(), Version, ErrVersion)
	}
	return h, nil
}

func ctxOr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("protocol: handshake: %w", cerr)
	}
	return err
}

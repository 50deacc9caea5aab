package client

import (
	"context"
	"sync"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Delete removes the object name. Its name disappears at once; its memory
// is freed when the last lease on it is released.
func (c *Client) Delete(ctx context.Context, name string) error {
	if err := checkName("delete", name); err != nil {
		return err
	}
	_, err := c.roundTrip(ctx, "delete", name, &storev1.Request{Body: &storev1.Request_Delete{Delete: &storev1.DeleteRequest{Name: name}}})
	return err
}

// List returns the objects this client may read, sorted by name: its
// own, and shared ones.
func (c *Client) List(ctx context.Context) ([]ObjectInfo, error) {
	var out []ObjectInfo
	after := ""
	for {
		r, err := c.roundTrip(ctx, "list", "", &storev1.Request{Body: &storev1.Request_List{List: &storev1.ListRequest{StartAfter: after}}})
		if err != nil {
			return nil, err
		}
		l := r.resp.GetList()
		for _, o := range l.GetObjects() {
			out = append(out, infoFromProto(o))
		}
		if !l.GetMore() || len(l.GetObjects()) == 0 {
			return out, nil
		}
		after = out[len(out)-1].Name
	}
}

// Stat describes the object name.
func (c *Client) Stat(ctx context.Context, name string) (ObjectInfo, error) {
	if err := checkName("stat", name); err != nil {
		return ObjectInfo{}, err
	}
	r, err := c.roundTrip(ctx, "stat", name, &storev1.Request{Body: &storev1.Request_Stat{Stat: &storev1.StatRequest{Name: name}}})
	if err != nil {
		return ObjectInfo{}, err
	}
	return infoFromProto(r.resp.GetStat().GetInfo()), nil
}

// Subscribe returns a channel of store events (seals, deletions,
// evictions, aborts) that happen from now on. The channel is closed when
// ctx ends or the connection is lost. Events are queued, never dropped,
// so a slow reader costs memory, not events.
func (c *Client) Subscribe(ctx context.Context) (<-chan Event, error) {
	s := &subscription{ch: make(chan Event), wake: make(chan struct{}, 1)}
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return nil, &Error{Op: "subscribe", Err: err}
	}
	c.subs[s] = struct{}{}
	c.mu.Unlock()
	if _, err := c.roundTrip(ctx, "subscribe", "", &storev1.Request{Body: &storev1.Request_Subscribe{Subscribe: &storev1.SubscribeRequest{}}}); err != nil {
		c.mu.Lock()
		delete(c.subs, s)
		c.mu.Unlock()
		return nil, err
	}
	go s.deliver(ctx, c)
	return s.ch, nil
}

type subscription struct {
	ch   chan Event
	wake chan struct{}

	mu    sync.Mutex
	queue []Event
	ended bool
}

func (s *subscription) push(ev Event) {
	s.mu.Lock()
	s.queue = append(s.queue, ev)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// end marks the subscription over: queued events are still delivered.
func (s *subscription) end() {
	s.mu.Lock()
	s.ended = true
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *subscription) deliver(ctx context.Context, c *Client) {
	defer close(s.ch)
	defer func() {
		c.mu.Lock()
		delete(c.subs, s)
		c.mu.Unlock()
	}()
	for {
		s.mu.Lock()
		if len(s.queue) == 0 {
			ended := s.ended
			s.mu.Unlock()
			if ended {
				return
			}
			select {
			case <-s.wake:
				continue
			case <-ctx.Done():
				return
			}
		}
		ev := s.queue[0]
		s.queue = s.queue[1:]
		s.mu.Unlock()
		select {
		case s.ch <- ev:
		case <-ctx.Done():
			return
		}
	}
}

// dispatch hands an event to every subscription; called by the reader.
func (c *Client) dispatch(ev *storev1.Event) {
	e := Event{Kind: protocol.EventName(ev.GetKind()), Name: ev.GetName(), Version: ev.GetVersion()}
	if e.Kind == "" {
		return // a kind from a newer daemon
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for s := range c.subs {
		s.push(e)
	}
}

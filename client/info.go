package client

import (
	"encoding/json"
	"time"
)

// ObjectInfo describes an object in the store. Its JSON form is what
// 'cudaipc stat --json' prints.
type ObjectInfo struct {
	Name     string    `json:"name"`
	Size     int64     `json:"size"`
	Device   string    `json:"device"` // "host", or a GPU UUID ("GPU-…")
	Sealed   bool      `json:"sealed"`
	Leases   int       `json:"leases"` // live leases on the object
	Shared   bool      `json:"shared"` // readable by every uid the daemon admits
	OwnerUID uint32    `json:"owner_uid"`
	Created  time.Time `json:"created"`
	// Region is the region (docs/region.md, JSON encoding) of exactly the
	// object's GPU memory, which 'cudaipc dump --region' and CuPy or
	// PyTorch can map; empty (JSON null) for host memory and for GPU
	// objects of a daemon sharing by descriptor (--gpu-share fd), which
	// have no region another process could open. Always present in
	// JSON so that scripts can test it. Like any region it is a bearer
	// capability for the object's memory.
	Region json.RawMessage `json:"region"`
}

// Event is a change in the store, delivered to subscribers.
type Event struct {
	Kind string // EventSealed, EventDeleted, EventEvicted or EventAborted
	Name string // the object's name
}

// Event kinds.
const (
	EventSealed  = "sealed"
	EventDeleted = "deleted"
	EventEvicted = "evicted"
	EventAborted = "aborted"
)

// ServerInfo is what the daemon said about itself in the handshake.
type ServerInfo struct {
	Version       uint32 // protocol version
	ServerVersion string // daemon build version
	PID           int    // daemon process id
	Backend       string // memory backend, e.g. "host"
}

// CreateOptions are the options of Client.Create.
type CreateOptions struct {
	// Device is where the memory lives: "" or "host" for host memory, a
	// GPU UUID ("GPU-…"), or a GPU ordinal ("0", "1", …), which Create
	// resolves to the UUID of this process's GPU of that ordinal. GPU
	// objects need a daemon with the cuda backend.
	Device string
	// Shared makes the sealed object readable by every uid the daemon
	// admits, not only by its creator's uid.
	Shared bool
}

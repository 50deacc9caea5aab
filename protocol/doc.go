// Package protocol is the wire format of the cudaipc object store: how the
// daemon (package store) and its clients (package client, or any program
// following docs/protocol.md) talk over a Unix SOCK_SEQPACKET socket.
//
// # Framing
//
// One packet carries one protobuf message (schema in storev1/store.proto):
// a storev1.Request from client to server, a storev1.Response back. Packets
// are at most MaxMessageSize bytes and carry at most MaxFiles file
// descriptors as SCM_RIGHTS ancillary data. Conn implements this framing
// and reports violations as a *MessageError matching ErrTooLarge,
// ErrMalformed or ErrTooManyFiles; the receiving side should then close the
// connection.
//
// # Ownership of files
//
// Files passed to Conn.Send stay owned by the caller; the kernel gives the
// peer its own duplicates. Files returned by Conn.Recv belong to the caller,
// who must close them (CloseFiles helps); on any error Recv has already
// closed them, so a bad packet never leaks descriptors.
//
// # Errors
//
// A failed request is answered with a Response whose Error has a code;
// ErrorResponse builds one from a Go error and ResponseError turns one back
// into a *CodeError, which matches (errors.Is) the sentinel of its code:
// ErrNotFound, ErrExists, ErrTimeout, ErrStoreFull, ErrPermission, ErrLimit,
// ErrInvalid, ErrNotSealed, ErrSealed, ErrVersion, ErrInternal, and for a
// daemon in a cluster ErrUnavailable (retry later) and ErrDataLoss (a record
// or chunk does not verify). CodeOf maps such errors, however wrapped, back
// to codes, so server and client share one table; package cluster's
// sentinels wrap these, so its failures keep their class on the wire.
//
// # Handshake
//
// A client's first request is a hello naming the protocol Version; the
// server answers with its own hello, or with a VERSION error and closes.
// ClientHello does the client side; a server checks the request with
// ValidateRequest and CheckVersion.
//
// # Validation
//
// ValidateRequest (server side) and ValidateResponse (client side) check
// everything about a message that does not depend on the store's state:
// ids, names, sizes, placements and how many files came with it. ListPage
// cuts a listing into packets that fit; NewEvent builds the packets sent to
// subscribers.
package protocol

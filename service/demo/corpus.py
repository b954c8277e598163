"""A small demo knowledge base the project writes itself: English and Chinese, FAQ and
documents, two approved versions of the release notes, a draft and a retired source, and
one document restricted to the ``support`` group. ``make run`` ingests it; the end-to-end
tests query it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEMO_DOCUMENTS: list[dict[str, Any]] = [
    {
        "source_id": "kb-password-reset", "version": "v1", "collection": "doc",
        "title": "Resetting your password",
        "breadcrumb": "Help Center > Account",
        "metadata": {"category": "troubleshooting", "lang": "en"},
        "text": (
            "# Forgotten password\n"
            "If you forgot your password, open the sign-in page and choose 'Forgot password'. "
            "We email a reset link that stays valid for 30 minutes. Follow the link and pick a "
            "new password of at least 12 characters.\n\n"
            "# Reset link expired\n"
            "A reset link can be used once. If it expired, request a new one; older links stop "
            "working as soon as a new link is sent.\n\n"
            "# Locked account\n"
            "After five failed sign-in attempts the account is locked for 15 minutes. Support "
            "can unlock it earlier after verifying your identity."
        ),
    },
    {
        "source_id": "kb-billing", "version": "v1", "collection": "doc",
        "title": "Billing and invoices",
        "breadcrumb": "Help Center > Billing",
        "metadata": {"category": "pricing", "lang": "en"},
        "text": (
            "# Billing cycle\n"
            "Subscriptions are billed monthly on the day you signed up. Annual plans are billed "
            "once a year and save 20 percent compared with monthly billing.\n\n"
            "# Invoices\n"
            "Invoices are issued as PDF files and can be downloaded from Settings > Billing. "
            "Each invoice lists the plan, the seats and the tax applied.\n\n"
            "# Payment methods\n"
            "We accept credit cards and bank transfer. Bank transfers take up to three business "
            "days to clear."
        ),
    },
    {
        "source_id": "kb-refund-zh", "version": "v1", "collection": "doc",
        "title": "退款政策",
        "breadcrumb": "帮助中心 > 计费",
        "metadata": {"category": "pricing", "lang": "zh"},
        "text": (
            "# 退款条件\n"
            "购买后十四天内可以申请全额退款。超过十四天的订单不支持退款，但可以在下一个计费周期前取消续订。\n\n"
            "# 退款流程\n"
            "在账户设置中提交退款申请，客服会在三个工作日内审核。审核通过后，款项将原路退回到您的付款账户。"
        ),
    },
    {
        "source_id": "kb-security-zh", "version": "v1", "collection": "doc",
        "title": "账户安全与两步验证",
        "breadcrumb": "帮助中心 > 账户",
        "metadata": {"category": "compliance", "lang": "zh"},
        "text": (
            "# 两步验证\n"
            "开启两步验证后，登录时除了密码还需要输入手机验证码。我们建议所有管理员账户开启两步验证。\n\n"
            "# 异常登录\n"
            "如果系统检测到来自新设备的异常登录，会向您的邮箱发送安全提醒，并要求重新验证身份。"
        ),
    },
    {
        "source_id": "kb-data-retention", "version": "v1", "collection": "doc",
        "title": "Data retention and deletion",
        "breadcrumb": "Help Center > Compliance",
        "metadata": {"category": "compliance", "lang": "en"},
        "text": (
            "# Retention period\n"
            "Deleted files stay in the trash for 30 days and are then removed permanently. Audit "
            "logs are kept for one year to meet compliance requirements.\n\n"
            "# Account deletion\n"
            "When an account is closed, all customer data is erased within 60 days, except "
            "invoices, which the law requires us to keep for seven years."
        ),
    },
    {
        "source_id": "release-notes", "version": "v2.3", "collection": "doc",
        "title": "Release notes v2.3",
        "breadcrumb": "Product > Release notes",
        "metadata": {"category": "summary", "lang": "en"},
        "text": (
            "# What's new in v2.3\n"
            "Version v2.3 introduces offline sync for the desktop app: files marked 'available "
            "offline' are kept on the device and synchronised when the connection returns.\n\n"
            "# Fixes in v2.3\n"
            "Fixed slow uploads of large folders."
        ),
    },
    {
        "source_id": "release-notes", "version": "v2.4", "collection": "doc",
        "title": "Release notes v2.4",
        "breadcrumb": "Product > Release notes",
        "metadata": {"category": "summary", "lang": "en"},
        "text": (
            "# What's new in v2.4\n"
            "Version v2.4 adds single sign-on (SSO) with SAML 2.0 and lets administrators "
            "enforce SSO for every member of the workspace.\n\n"
            "# Fixes in v2.4\n"
            "Fixed a crash when renaming shared folders."
        ),
    },
    {
        "source_id": "pricing-2027", "version": "v1", "collection": "doc", "status": "draft",
        "title": "Quantum tier pricing (draft)",
        "breadcrumb": "Product > Pricing",
        "metadata": {"category": "pricing", "lang": "en"},
        "text": "The Quantum tier will cost 99 dollars per seat per month and include unlimited archival storage.",
    },
    {
        "source_id": "legacy-fax-support", "version": "v1", "collection": "doc", "status": "retired",
        "title": "Sending documents by fax",
        "breadcrumb": "Help Center > Legacy",
        "metadata": {"category": "troubleshooting", "lang": "en"},
        "text": "Documents can be sent to our fax gateway at extension 4410. This service was retired.",
    },
    {
        "source_id": "internal-escalation", "version": "v1", "collection": "doc",
        "title": "Escalation runbook",
        "breadcrumb": "Support > Internal",
        "acl": ["support"],
        "metadata": {"category": "troubleshooting", "lang": "en"},
        "text": "Escalate outages to the on-call engineer through the paging rotation named orion-pager within 10 minutes.",
    },
    {
        "source_id": "kb-desktop-requirements", "version": "v1", "collection": "doc",
        "title": "System requirements",
        "breadcrumb": "Help Center > Getting started",
        "metadata": {"category": "troubleshooting", "lang": "en"},
        "text": (
            "# Supported versions\n"
            "Which versions does the desktop app need? It needs Windows 10 or later, or macOS 12 or "
            "later, with 4 GB of memory and 2 GB of free disk space. Older versions are not supported."
        ),
    },
    {
        "source_id": "kb-mobile-app", "version": "v1", "collection": "doc",
        "title": "Installing the mobile app",
        "breadcrumb": "Help Center > Mobile",
        "metadata": {"lang": "en"},
        "text": (
            "# Installing the mobile app\n"
            "Download the mobile app from the App Store or Google Play and sign in with your work email.\n\n"
            "# Supported phones\n"
            "The mobile app needs iOS 16 or Android 12 or later."
        ),
    },
    {
        "source_id": "faq-expense-zh", "version": "v1", "collection": "faq",
        "title": "报销流程是什么？",
        "breadcrumb": "常见问题 > 报销",
        "metadata": {"lang": "zh"},
        "text": "报销流程是什么？在费用系统提交报销单并上传票据，直属经理审批通过后，财务在五个工作日内付款。",
    },
    {
        "source_id": "faq-change-email", "version": "v1", "collection": "faq",
        "title": "How do I change my email address?",
        "breadcrumb": "FAQ > Account",
        "metadata": {"category": "troubleshooting", "lang": "en"},
        "text": "How do I change my email address? Go to Settings > Profile, enter the new address and confirm it from the verification email.",
    },
    {
        "source_id": "faq-cancel", "version": "v1", "collection": "faq",
        "title": "Can I cancel my subscription at any time?",
        "breadcrumb": "FAQ > Billing",
        "metadata": {"category": "pricing", "lang": "en"},
        "text": "Can I cancel my subscription at any time? Yes. Cancel from Settings > Billing; the plan stays active until the end of the paid period.",
    },
    {
        "source_id": "faq-invoice-zh", "version": "v1", "collection": "faq",
        "title": "如何开具发票？",
        "breadcrumb": "常见问题 > 计费",
        "metadata": {"category": "pricing", "lang": "zh"},
        "text": "如何开具发票？登录后进入设置中的账单页面，填写公司抬头和税号，即可下载电子发票。",
    },
    {
        "source_id": "faq-storage-zh", "version": "v1", "collection": "faq",
        "title": "免费版有多少存储空间？",
        "breadcrumb": "常见问题 > 套餐",
        "metadata": {"category": "pricing", "lang": "zh"},
        "text": "免费版有多少存储空间？免费版提供五十GB存储空间，升级到专业版可获得两TB空间。",
    },
]


def write_demo_corpus(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for doc in DEMO_DOCUMENTS:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return len(DEMO_DOCUMENTS)

"""Wiki markup stripping."""

from __future__ import annotations

from train_deploy.corpus.wiki import strip_wiki_markup


def test_nested_templates_tables_and_references_are_dropped():
    text = ("开头{{a|{{b|c}}|d}}中间<ref name=x>引用{{cite}}</ref>后<ref name=y/>面\n"
            "{| class=wikitable\n|-\n| 单元 || 格\n|}\n结尾<!-- 注释 -->。")
    assert strip_wiki_markup(text) == "开头中间后面\n\n结尾。"


def test_links_keep_their_label_and_files_categories_vanish():
    text = "[[北京]]和[[上海市|上海]]；[[文件:图.png|缩略图|说明[[链接]]]][[分类:城市]][https://example.org 外部网站]"
    assert strip_wiki_markup(text) == "北京和上海；外部网站"


def test_chinese_language_conversion_prefers_simplified():
    assert strip_wiki_markup("-{zh-hant:軟體;zh-hans:软件;}-和-{Linux}-") == "软件和Linux"


def test_headings_lists_bold_and_entities():
    text = "== 标题 ==\n* 项目一\n# 项目二\n'''粗体'''与''斜体''&nbsp;&amp;"
    assert strip_wiki_markup(text) == "标题\n项目一\n项目二\n粗体与斜体\xa0&"
